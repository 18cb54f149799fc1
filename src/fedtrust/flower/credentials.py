"""Credentials for a Flower deployment: a private CA with a SuperLink TLS certificate, and the EC key pairs
SuperNodes authenticate with. For trials and closed networks; a production SuperLink should use a
certificate from the organisation's CA."""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _name(common_name: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "fedtrust"),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def tls_certificates(
    out: str | Path, hosts: list[str] | tuple[str, ...] = ("127.0.0.1", "localhost"), days: int = 365
) -> dict[str, Path]:
    """Write ``ca.crt`` (a new CA), ``server.pem`` and ``server.key`` (the SuperLink's certificate, valid for
    every name or IP address in ``hosts``) under ``out``. Returns their paths by those names.

    The SuperLink takes ``--ssl-ca-certfile ca.crt --ssl-certfile server.pem --ssl-keyfile server.key``;
    SuperNodes take ``--root-certificates ca.crt``, and the ``flwr`` CLI's connection
    ``root-certificates = "ca.crt"``."""
    if not hosts:
        raise ValueError("tls_certificates: hosts must name at least one host name or IP address")
    for host in hosts:
        check_host(host)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)

    ca_key = ec.generate_private_key(ec.SECP384R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(_name("fedtrust CA"))
        .issuer_name(_name("fedtrust CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
        )
        .sign(ca_key, hashes.SHA256())
    )

    names: list[x509.GeneralName] = []
    for host in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            names.append(x509.DNSName(host))
    server_key = ec.generate_private_key(ec.SECP384R1())
    server = (
        x509.CertificateBuilder()
        .subject_name(_name(hosts[0]))
        .issuer_name(ca.subject)
        .public_key(server_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )

    paths = {"ca.crt": out / "ca.crt", "server.pem": out / "server.pem", "server.key": out / "server.key"}
    paths["ca.crt"].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths["server.pem"].write_bytes(server.public_bytes(serialization.Encoding.PEM))
    _write_key(paths["server.key"], server_key)
    return paths


#: A host name's label: letters, digits, inner hyphens (RFC 1123) and underscores (Docker service names
#: such as superlink_1), 1-63 characters.
_LABEL = re.compile(r"^[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?$")


def check_host(host: str) -> str:
    """``host`` when it is an IP address or a DNS name a certificate can hold (a wildcard ``*.example.org``
    too); else a ValueError naming it (an empty name, 'a b/c', or 999.1.1.1, which reads as an IPv4
    address and is not one)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    labels = host.removeprefix("*.").removesuffix(".").split(".")  # (a wildcard name: *.example.org)
    if not (0 < len(host) <= 253 and all(_LABEL.match(label) for label in labels)):
        raise ValueError(f"host {host!r} is neither an IP address nor a DNS name (letters, digits, "
                         "hyphens and underscores in dot-separated parts)")  # fmt: skip
    if all(label.isdigit() for label in labels):
        raise ValueError(f"host {host!r} reads as an IP address but is not one")
    return host


def certificate_hosts(path: str | Path) -> list[str]:
    """The host names and IP addresses a certificate (PEM) is valid for; a ValueError naming the file
    when it holds no readable certificate with them."""
    try:
        cert = x509.load_pem_x509_certificate(Path(path).read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound) as exc:
        raise ValueError(f"{path} is not a readable server certificate ({exc})") from None
    return [
        str(v) for v in names.get_values_for_type(x509.IPAddress) + names.get_values_for_type(x509.DNSName)
    ]


def supernode_keys(out: str | Path, name: str) -> tuple[Path, Path]:
    """An EC (NIST P-384) key pair in OpenSSH format, as Flower's SuperNode authentication reads it:
    ``<name>`` (private: ``flower-supernode --auth-supernode-private-key``) and ``<name>.pub`` (public:
    ``flwr supernode register <name>.pub``). Same as ``ssh-keygen -t ecdsa -b 384 -N "" -f <name>``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP384R1())
    private, public = out / name, out / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH, serialization.NoEncryption()
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        + b"\n"
    )
    return private, public
