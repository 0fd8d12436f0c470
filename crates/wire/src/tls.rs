//! TLS configuration from PEM files, for servers that offer TLS (the NBD server's STARTTLS)
//! and the links that use it: a certificate chain and its key, and optionally a CA that client
//! certificates must chain to.
//!
//! rustls with the `ring` provider, chosen explicitly (not the process default) so that no
//! other crate's choice of provider changes what these servers accept. Protocol versions are
//! rustls's safe defaults (TLS 1.2 and 1.3): gnutls (qemu, libnbd) negotiates 1.3 with it.

use std::path::{Path, PathBuf};
use std::sync::Arc;

pub use tokio_rustls;
pub use tokio_rustls::rustls;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::WireError;

/// The PEM files of a TLS server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerFiles {
    /// The server's certificate chain, leaf first.
    pub cert: PathBuf,
    /// The private key of the leaf certificate (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// When given, clients must present a certificate that chains to one of these CAs.
    pub client_ca: Option<PathBuf>,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates in a PEM file (at least one).
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, WireError> {
    let certs: Vec<_> = CertificateDer::pem_file_iter(path)
        .map_err(|e| WireError::Tls(format!("cannot read certificates from {}: {e}", path.display())))?
        .collect::<Result<_, _>>()
        .map_err(|e| WireError::Tls(format!("{} is not a PEM certificate file: {e}", path.display())))?;
    if certs.is_empty() {
        return Err(WireError::Tls(format!("no certificate in {}", path.display())));
    }
    Ok(certs)
}

/// The private key in a PEM file.
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, WireError> {
    PrivateKeyDer::from_pem_file(path).map_err(|e| WireError::Tls(format!("no private key in {}: {e}", path.display())))
}

fn roots(path: &Path) -> Result<rustls::RootCertStore, WireError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certs(path)? {
        roots.add(c).map_err(|e| WireError::Tls(format!("a CA certificate in {} is unusable: {e}", path.display())))?;
    }
    Ok(roots)
}

/// A server configuration from `files`; fails with the file and the reason when a file is
/// missing, holds no certificate or key, or the key does not match the certificate.
pub fn server_config(files: &ServerFiles) -> Result<Arc<rustls::ServerConfig>, WireError> {
    let certs = load_certs(&files.cert)?;
    let key = load_key(&files.key)?;
    let builder = rustls::ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| WireError::Tls(e.to_string()))?;
    let builder = match &files.client_ca {
        Some(ca) => {
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots(ca)?), provider())
                .build()
                .map_err(|e| WireError::Tls(format!("client CA {}: {e}", ca.display())))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        WireError::Tls(format!("the key {} does not fit the certificate {}: {e}", files.key.display(), files.cert.display()))
    })?;
    Ok(Arc::new(config))
}

/// A TLS acceptor for `files` (see [`server_config`]).
pub fn acceptor(files: &ServerFiles) -> Result<tokio_rustls::TlsAcceptor, WireError> {
    Ok(tokio_rustls::TlsAcceptor::from(server_config(files)?))
}

/// A client configuration trusting the CAs in `ca`, presenting `cert`/`key` when given.
pub fn client_config(ca: &Path, cert_key: Option<(&Path, &Path)>) -> Result<Arc<rustls::ClientConfig>, WireError> {
    let builder = rustls::ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| WireError::Tls(e.to_string()))?
        .with_root_certificates(roots(ca)?);
    let config = match cert_key {
        Some((cert, key)) => builder
            .with_client_auth_cert(load_certs(cert)?, load_key(key)?)
            .map_err(|e| WireError::Tls(format!("the key {} does not fit the certificate {}: {e}", key.display(), cert.display())))?,
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// A throw-away CA with a server certificate (for `localhost` and 127.0.0.1, also usable as a
/// client certificate: a cluster link's identity) and a client certificate, written as PEM files for tests, in the layout gnutls clients read (qemu's
/// `tls-creds-x509,dir=`, libnbd's `tls-certificates=`).
#[cfg(feature = "test-pki")]
pub struct TestPki {
    pub dir: PathBuf,
}

#[cfg(feature = "test-pki")]
impl TestPki {
    /// Writes into `dir` (created): `ca-cert.pem`, `server-cert.pem`, `server-key.pem`;
    /// `with-cert/` (ca-cert.pem, client-cert.pem, client-key.pem) and `ca-only/` (ca-cert.pem).
    pub fn write(dir: &Path) -> TestPki {
        use std::net::{IpAddr, Ipv4Addr};
        for d in ["with-cert", "ca-only"] {
            std::fs::create_dir_all(dir.join(d)).unwrap();
        }
        let mut ca_params = rcgen::CertificateParams::new(vec![]).unwrap();
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, "understudy test CA");
        ca_params.key_usages = vec![rcgen::KeyUsagePurpose::KeyCertSign, rcgen::KeyUsagePurpose::CrlSign];
        let ca_key = rcgen::KeyPair::generate().unwrap();
        let ca = ca_params.self_signed(&ca_key).unwrap();
        let issue = |cn: &str, sans: Vec<rcgen::SanType>, usages: Vec<rcgen::ExtendedKeyUsagePurpose>| {
            let key = rcgen::KeyPair::generate().unwrap();
            let mut p = rcgen::CertificateParams::new(vec![]).unwrap();
            p.distinguished_name.push(rcgen::DnType::CommonName, cn);
            p.subject_alt_names = sans;
            p.extended_key_usages = usages;
            p.key_usages = vec![rcgen::KeyUsagePurpose::DigitalSignature, rcgen::KeyUsagePurpose::KeyEncipherment];
            (p.signed_by(&key, &ca, &ca_key).unwrap().pem(), key.serialize_pem())
        };
        let (server_cert, server_key) = issue(
            "localhost",
            vec![
                rcgen::SanType::DnsName("localhost".try_into().unwrap()),
                rcgen::SanType::IpAddress(IpAddr::V4(Ipv4Addr::LOCALHOST)),
            ],
            // Both: a cluster process presents it as server and as client (see `link`).
            vec![rcgen::ExtendedKeyUsagePurpose::ServerAuth, rcgen::ExtendedKeyUsagePurpose::ClientAuth],
        );
        let (client_cert, client_key) = issue("client", vec![], vec![rcgen::ExtendedKeyUsagePurpose::ClientAuth]);
        let write = |name: &str, text: &str| std::fs::write(dir.join(name), text).unwrap();
        write("ca-cert.pem", &ca.pem());
        write("server-cert.pem", &server_cert);
        write("server-key.pem", &server_key);
        write("with-cert/ca-cert.pem", &ca.pem());
        write("with-cert/client-cert.pem", &client_cert);
        write("with-cert/client-key.pem", &client_key);
        write("ca-only/ca-cert.pem", &ca.pem());
        TestPki { dir: dir.to_path_buf() }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.join(name)
    }

    /// The server's files; client certificates required when `client_certs`.
    pub fn server_files(&self, client_certs: bool) -> ServerFiles {
        ServerFiles {
            cert: self.path("server-cert.pem"),
            key: self.path("server-key.pem"),
            client_ca: client_certs.then(|| self.path("ca-cert.pem")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// (ca, server cert, server key, client cert, client key) of a [`TestPki`] in `dir`.
    fn make_pki(dir: &Path) -> [PathBuf; 5] {
        let p = TestPki::write(dir);
        ["ca-cert.pem", "server-cert.pem", "server-key.pem", "with-cert/client-cert.pem", "with-cert/client-key.pem"].map(|n| p.path(n))
    }

    /// One byte each way over TLS on loopback; the client's error, if any.
    async fn exchange(server: Arc<rustls::ServerConfig>, client: Arc<rustls::ClientConfig>) -> Result<(), String> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = l.local_addr().unwrap();
        let acceptor = tokio_rustls::TlsAcceptor::from(server);
        let srv = tokio::spawn(async move {
            let (s, _) = l.accept().await.unwrap();
            let mut t = acceptor.accept(s).await.map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            t.read_exact(&mut b).await.map_err(|e| e.to_string())?;
            t.write_all(&b).await.map_err(|e| e.to_string())?;
            t.flush().await.map_err(|e| e.to_string())
        });
        let connector = tokio_rustls::TlsConnector::from(client);
        let s = tokio::net::TcpStream::connect(addr).await.unwrap();
        let name = rustls::pki_types::ServerName::try_from("localhost").unwrap();
        let r = async {
            let mut t = connector.connect(name, s).await.map_err(|e| e.to_string())?;
            t.write_all(b"x").await.map_err(|e| e.to_string())?;
            let mut b = [0u8; 1];
            // TLS 1.3: a refused client certificate shows on the first read.
            t.read_exact(&mut b).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(())
        }
        .await;
        let _ = srv.await;
        r
    }

    #[tokio::test]
    async fn client_certificates_are_required_when_a_ca_is_given() {
        let d = tempfile_dir();
        let [ca, cert, key, ccert, ckey] = make_pki(d.path());
        let with_ca = server_config(&ServerFiles { cert: cert.clone(), key: key.clone(), client_ca: Some(ca.clone()) }).unwrap();
        exchange(with_ca.clone(), client_config(&ca, Some((&ccert, &ckey))).unwrap()).await.unwrap();
        let r = exchange(with_ca, client_config(&ca, None).unwrap()).await;
        assert!(r.is_err(), "a client without a certificate got through");
        let without_ca = server_config(&ServerFiles { cert, key, client_ca: None }).unwrap();
        exchange(without_ca, client_config(&ca, None).unwrap()).await.unwrap();
    }

    #[test]
    fn bad_files_get_clear_errors() {
        let d = tempfile_dir();
        let [ca, cert, key, ccert, _] = make_pki(d.path());
        let err = |files: ServerFiles| server_config(&files).unwrap_err().to_string();
        let e = err(ServerFiles { cert: d.path().join("missing.pem"), key: key.clone(), client_ca: None });
        assert!(e.contains("missing.pem"), "{e}");
        let e = err(ServerFiles { cert: cert.clone(), key: cert.clone(), client_ca: None });
        assert!(e.contains("no private key"), "{e}");
        let e = err(ServerFiles { cert: ccert, key: key.clone(), client_ca: None });
        assert!(e.contains("does not fit"), "{e}");
        let e = err(ServerFiles { cert: key.clone(), key, client_ca: Some(ca) });
        assert!(e.contains("no certificate"), "{e}");
    }

    /// A temporary directory removed on drop (wire has no tempfile dependency).
    struct TempDir(PathBuf);
    impl TempDir {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn tempfile_dir() -> TempDir {
        let p = std::env::temp_dir().join(format!("wire-tls-{}-{}", std::process::id(), rand::random::<u64>()));
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}
