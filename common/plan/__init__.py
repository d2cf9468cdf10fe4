"""Planning an update between two layouts: intersections, assignment, packing into buckets and
rounds, relays, the digest (`planner`); checksum slots in plan order (`verify`)."""
