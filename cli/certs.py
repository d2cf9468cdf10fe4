"""`reshard certs --out DIR`: a development CA, a server certificate, one client certificate
and one token per role, so that services run with TLS and tokens (or mutual TLS) from the start.

Writes ca.pem; server.pem + server-key.pem (the services', for server and client use, with the
peer role: the trainer controller presents it to inference); operator.pem, admin.pem,
worker.pem and their -key.pem (client certificates, each with its role); and operator.token,
admin.token, peer.token, worker.token (keys and tokens readable by their owner only). A
certificate's role is its URI SAN `reshard-role:ROLE`, which a service with `--mtls` takes as
a credential like the role's token. A service takes `--tls-cert server.pem --tls-key
server-key.pem --tls-ca ca.pem --tokens-dir DIR`; an operator `--tls-ca ca.pem --token-file
DIR/operator.token`, and with mutual TLS `--tls-cert operator.pem --tls-key operator-key.pem`.
For production, issue the certificates from your own CA and keep the tokens in your secret store.

`--keep-existing` makes it safe to run at every start (docker-compose.yml's `certs` service):
a folder that already holds every file is left as it is (same CA, same tokens), an empty one is
filled, and one that holds only some of them is refused, never completed or overwritten (a
complete set an older version wrote, with a role-less client.pem, is kept with a warning: its
certificates grant no role with mutual TLS; issue a new set for role certificates)."""

from __future__ import annotations

import datetime
import ipaddress
import os
import secrets
import sys

from reshard.common.control.security import ROLE_URI, ROLES

CLIENT_ROLES = ("operator", "admin", "worker")  # a client certificate each; the peer's is server.pem
ROLE_FILES = tuple(f for r in CLIENT_ROLES for f in (f"{r}.pem", f"{r}-key.pem"))
FILES = ("ca.pem", "server.pem", "server-key.pem", *ROLE_FILES, *(f"{r}.token" for r in ROLES))
OLD_FILES = ("client.pem", "client-key.pem")  # older versions' role-less client certificate, in place of ROLE_FILES


def add_parser(sub) -> None:
    p = sub.add_parser("certs", help="write a development CA, certificates and tokens (TLS and tokens on from the start)",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write into (created; existing files are kept unless --force)")
    p.add_argument("--host", action="append", default=[],
                   help="a name or IP address the server certificate is valid for (repeat; default localhost and 127.0.0.1)")
    p.add_argument("--days", type=int, default=365, help="validity of the certificates (default 365)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--force", action="store_true", help="overwrite existing files")
    g.add_argument("--keep-existing", action="store_true",
                   help="succeed without writing when --out already holds every file (a restart keeps its CA and "
                        "tokens); still refuse a folder holding only some of them")
    p.set_defaults(_main=main)


def _write(path: str, data: bytes, private: bool) -> None:
    mode = 0o600 if private else 0o644
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), mode)  # --force over an existing file: O_CREAT's mode applies to new files only
        f.write(data)


def _server_names(path: str) -> set[str]:
    """The names (DNS and IP SANs) an existing server certificate is valid for; empty if unreadable."""
    from cryptography import x509

    try:
        with open(path, "rb") as f:
            cert = x509.load_pem_x509_certificate(f.read())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return set()
    return {*san.get_values_for_type(x509.DNSName), *(str(ip) for ip in san.get_values_for_type(x509.IPAddress))}


def main(a) -> int:
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        print("reshard certs needs the cryptography package: pip install 'reshard[tls]'", file=sys.stderr)
        return 2
    if a.days < 1:
        print("reshard certs: --days must be at least 1", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    present = [f for f in FILES if os.path.exists(os.path.join(a.out, f))]
    old = [f for f in OLD_FILES if os.path.exists(os.path.join(a.out, f))]
    hosts = a.host or ["localhost", "127.0.0.1"]
    if a.keep_existing and len(present) == len(FILES):
        missing = [h for h in hosts if h not in _server_names(os.path.join(a.out, "server.pem"))]
        if missing:
            print(f"reshard certs: warning: the kept {a.out}/server.pem is not valid for {', '.join(missing)}; "
                  "delete the folder's files or pass --force to issue new ones", file=sys.stderr)
        print(f"kept the existing {', '.join(FILES)} in {a.out}")
        return 0
    if a.keep_existing and len(old) == len(OLD_FILES) and set(present) == set(FILES) - set(ROLE_FILES):
        # An older version's complete set: still good for TLS and tokens. Its certificates carry no
        # role, so with mutual TLS they grant nothing by themselves (refused, never let through).
        print(f"reshard certs: warning: kept {a.out}, a set an older reshard wrote: its certificates carry no role "
              f"(server.pem not the peer role, the role-less {', '.join(OLD_FILES)} instead of "
              f"{', '.join(f'{r}.pem' for r in CLIENT_ROLES)}), so a service with --mtls takes roles from tokens only; "
              "for role certificates remove the folder's files (docker compose: `docker compose down -v`) or pass "
              "--force", file=sys.stderr)
        return 0
    if present and a.keep_existing:
        missing = [f for f in FILES if f not in present]
        print(f"reshard certs: {a.out} holds {', '.join(present)} but not {', '.join(missing)}; refusing to complete or "
              "overwrite a partial set: remove those files (or pass --force to replace them all)", file=sys.stderr)
        return 2
    if (present or old) and not a.force:
        print(f"reshard certs: {a.out} already holds {', '.join(present + old)}; pass --force to replace them "
              "(or --keep-existing to keep a complete set)", file=sys.stderr)
        return 2
    now = datetime.datetime.now(datetime.timezone.utc)

    def key():
        return ec.generate_private_key(ec.SECP256R1())

    def pem_key(k) -> bytes:
        return k.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())

    def name(cn: str):
        return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "reshard development"),
                          x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def builder(subject, issuer, pub):
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(pub)
                .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                .not_valid_after(now + datetime.timedelta(days=a.days)))

    ca_key = key()
    ca_name = name("reshard development CA")
    ca = (builder(ca_name, ca_name, ca_key.public_key())
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True, content_commitment=False,
                                       key_encipherment=False, data_encipherment=False, key_agreement=False,
                                       encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def san(h: str):
        try:
            return x509.IPAddress(ipaddress.ip_address(h))
        except ValueError:
            return x509.DNSName(h)

    def leaf(cn: str, usages, role: str, names=()):
        k = key()
        b = builder(name(cn), ca_name, k.public_key()).add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        b = b.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        sans = [*(san(h) for h in names), x509.UniformResourceIdentifier(ROLE_URI + role)]
        b = b.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return k, b.sign(ca_key, hashes.SHA256())

    # Services also call each other (and their workers call them): their certificate serves both ends,
    # and as a client holds the peer role (the trainer controller's calls to inference).
    pem = serialization.Encoding.PEM
    certs = {"server": leaf(hosts[0], [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH], "peer", hosts)}
    certs |= {r: leaf(f"reshard {r}", [ExtendedKeyUsageOID.CLIENT_AUTH], r) for r in CLIENT_ROLES}
    _write(os.path.join(a.out, "ca.pem"), ca.public_bytes(pem), False)
    for who, (k, cert) in certs.items():
        _write(os.path.join(a.out, f"{who}.pem"), cert.public_bytes(pem), False)
        _write(os.path.join(a.out, f"{who}-key.pem"), pem_key(k), True)
    for role in ROLES:
        _write(os.path.join(a.out, f"{role}.token"), (secrets.token_urlsafe(32) + "\n").encode(), True)
    for f in old:  # signed by the CA just replaced, and role-less: of no use
        os.unlink(os.path.join(a.out, f))
    print(f"wrote {', '.join(FILES)} to {a.out} (server certificate for {', '.join(hosts)}, valid {a.days} days)"
          + (f"; removed the old {', '.join(old)}" if old else ""))
    return 0
