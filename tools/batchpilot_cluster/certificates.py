"""A throwaway PKI for one run of the test control plane.

Everything is generated at ``up`` and deleted at ``down``: one CA signs the API server's serving
certificate and the client certificates (the admin one in ``system:masters``; the controller
manager, scheduler and kube-proxy under the user names that the bootstrap RBAC policy already
grants), and a separate key pair signs service-account tokens. A front-proxy CA whose key is
thrown away gives the API server a request-header CA to publish, which the controller manager and
scheduler otherwise complain about without end; nobody can sign for it. P-256 keys keep generation
instant.
"""

import dataclasses
import datetime
import ipaddress
from collections.abc import Sequence
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

VALIDITY = datetime.timedelta(days=7)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Identity:
    """A client certificate subject: the user name and the groups RBAC sees."""

    file_stem: str
    user: str
    groups: tuple[str, ...] = ()


ADMIN = Identity(file_stem="admin", user="batchpilot-e2e-admin", groups=("system:masters",))
CONTROLLER_MANAGER = Identity(file_stem="controller-manager", user="system:kube-controller-manager")
SCHEDULER = Identity(file_stem="scheduler", user="system:kube-scheduler")
KUBE_PROXY = Identity(file_stem="kube-proxy", user="system:kube-proxy")
APISERVER_KUBELET_CLIENT = Identity(
    file_stem="apiserver-kubelet-client",
    user="kube-apiserver-kubelet-client",
    groups=("system:masters",),  # as kubeadm did: logs, exec and port-forward through kubelets
)
CLIENTS = (ADMIN, CONTROLLER_MANAGER, SCHEDULER, KUBE_PROXY, APISERVER_KUBELET_CLIENT)


def node_identity(node_name: str) -> Identity:
    """A kubelet's client identity: the Node authorizer and NodeRestriction tie
    ``system:node:<name>`` in ``system:nodes`` to that node and its Pods."""
    return Identity(
        file_stem=f"node-{node_name}", user=f"system:node:{node_name}", groups=("system:nodes",)
    )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Pki:
    directory: Path

    @property
    def ca_cert(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def ca_key(self) -> Path:
        return self.directory / "ca.key"

    @property
    def front_proxy_ca_cert(self) -> Path:
        return self.directory / "front-proxy-ca.crt"

    @property
    def serving_cert(self) -> Path:
        return self.directory / "apiserver.crt"

    @property
    def serving_key(self) -> Path:
        return self.directory / "apiserver.key"

    @property
    def service_account_key(self) -> Path:
        return self.directory / "sa.key"

    @property
    def service_account_pub(self) -> Path:
        return self.directory / "sa.pub"

    def kubelet_serving_cert(self, node_name: str) -> Path:
        return self.directory / f"kubelet-{node_name}.crt"

    def kubelet_serving_key(self, node_name: str) -> Path:
        return self.directory / f"kubelet-{node_name}.key"

    def client_cert(self, identity: Identity) -> Path:
        return self.directory / f"{identity.file_stem}.crt"

    def client_key(self, identity: Identity) -> Path:
        return self.directory / f"{identity.file_stem}.key"


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    path.chmod(0o600)


def write_cert(path: Path, cert: x509.Certificate) -> None:
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def name(common_name: str, organizations: Sequence[str] = ()) -> x509.Name:
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    return x509.Name(attributes)


def issue(
    *,
    subject: x509.Name,
    public_key: ec.EllipticCurvePublicKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    is_ca: bool = False,
    usages: Sequence[x509.ObjectIdentifier] = (),
    dns_names: Sequence[str] = (),
    ip_addresses: Sequence[str] = (),
) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))  # tolerate small clock skew
        .not_valid_after(now + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=is_ca, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,  # ECDSA keys sign; they never encipher
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=is_ca,
                crl_sign=is_ca,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
    )
    if usages:
        builder = builder.add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
    if dns_names or ip_addresses:
        alternative_names: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
        alternative_names += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in ip_addresses]
        builder = builder.add_extension(
            x509.SubjectAlternativeName(alternative_names), critical=False
        )
    return builder.sign(issuer_key, hashes.SHA256())


def generate(directory: Path, *, dns_names: Sequence[str], ip_addresses: Sequence[str]) -> Pki:
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(directory=directory)

    ca_key = new_key()
    ca_name = name("batchpilot-e2e-ca")
    ca_cert = issue(
        subject=ca_name,
        public_key=ca_key.public_key(),
        issuer=ca_name,
        issuer_key=ca_key,
        is_ca=True,
    )
    write_key(pki.ca_key, ca_key)
    write_cert(pki.ca_cert, ca_cert)

    front_proxy_key = new_key()
    front_proxy_name = name("batchpilot-e2e-front-proxy-ca")
    write_cert(
        pki.front_proxy_ca_cert,
        issue(
            subject=front_proxy_name,
            public_key=front_proxy_key.public_key(),
            issuer=front_proxy_name,
            issuer_key=front_proxy_key,
            is_ca=True,
        ),
    )

    serving_key = new_key()
    write_key(pki.serving_key, serving_key)
    write_cert(
        pki.serving_cert,
        issue(
            subject=name("kube-apiserver"),
            public_key=serving_key.public_key(),
            issuer=ca_name,
            issuer_key=ca_key,
            usages=(ExtendedKeyUsageOID.SERVER_AUTH,),
            dns_names=dns_names,
            ip_addresses=ip_addresses,
        ),
    )

    for identity in CLIENTS:
        issue_client(pki, identity, ca_name=ca_name, ca_key=ca_key)

    service_account_key = new_key()
    write_key(pki.service_account_key, service_account_key)
    pki.service_account_pub.write_bytes(
        service_account_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return pki


def issue_client(
    pki: Pki, identity: Identity, *, ca_name: x509.Name, ca_key: ec.EllipticCurvePrivateKey
) -> None:
    client_key = new_key()
    write_key(pki.client_key(identity), client_key)
    write_cert(
        pki.client_cert(identity),
        issue(
            subject=name(identity.user, identity.groups),
            public_key=client_key.public_key(),
            issuer=ca_name,
            issuer_key=ca_key,
            usages=(ExtendedKeyUsageOID.CLIENT_AUTH,),
        ),
    )


def issue_node(pki: Pki, *, node_name: str, node_ip: str) -> None:
    """A real node's kubelet: its client identity and its serving certificate (for its name
    and InternalIP, which the API server dials for logs and exec), signed by the run's CA."""
    ca_key = serialization.load_pem_private_key(pki.ca_key.read_bytes(), password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError(f"{pki.ca_key} is not an EC key")
    ca_name = x509.load_pem_x509_certificate(pki.ca_cert.read_bytes()).subject
    issue_client(pki, node_identity(node_name), ca_name=ca_name, ca_key=ca_key)
    serving_key = new_key()
    write_key(pki.kubelet_serving_key(node_name), serving_key)
    write_cert(
        pki.kubelet_serving_cert(node_name),
        issue(
            subject=name(f"system:node:{node_name}", ("system:nodes",)),
            public_key=serving_key.public_key(),
            issuer=ca_name,
            issuer_key=ca_key,
            usages=(ExtendedKeyUsageOID.SERVER_AUTH,),
            dns_names=(node_name, "localhost"),
            ip_addresses=(node_ip, "127.0.0.1"),
        ),
    )
