"""The layout algebra: canonical tensors, boxes, pieces, buffers and layouts (`core`), their
columnar form and wire codec (`columns`), per-piece tables (`tables`), and the DTensor-like
placement form (`placement`)."""
