//! TLS for [`PostgresStore`](super::PostgresStore) (feature `tls`):
//! rustls with the ring provider, through tokio-postgres-rustls.
//!
//! What is checked follows libpq's `sslmode` (PostgreSQL manual, "SSL
//! Support", table "SSL Mode Descriptions"):
//!
//! | `sslmode` | TLS | chain to a trusted root | host name in the certificate |
//! |---|---|---|---|
//! | `disable` | never | - | - |
//! | `prefer` (default) | if the server offers it | only with `sslrootcert` | no |
//! | `require` | always | only with `sslrootcert` | no |
//! | `verify-ca` | always | yes | no |
//! | `verify-full` | always | yes | yes |
//!
//! The trusted roots are the PEM certificates of `sslrootcert=PATH` and only
//! those; with `sslrootcert=system`, or without `sslrootcert` under
//! `verify-ca`/`verify-full`, they are the operating system's roots
//! (rustls-native-certs: the same store libpq's `sslrootcert=system` reads,
//! and it follows the OS's updates, where a compiled-in list would age).
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::StoreError> {
//! let store = tower_idempotency_postgres::PostgresStore::open(
//!     "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ssl/db-ca.pem",
//! )
//! .await?;
//! # Ok(()) }
//! ```

use std::sync::Arc;

use rustls::client::WebPkiServerVerifier;
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres_rustls::MakeRustlsConnect;

use super::sslmode::{RootCert, SslMode};
use tower_idempotency::store::StoreError;

/// The connector for `mode` and `root_cert`.
///
/// # Errors
///
/// [`StoreError::Config`]: `sslrootcert` unreadable or holding no
/// certificate, or no system roots where they are needed.
pub(super) fn connector(
    mode: SslMode,
    root_cert: &RootCert,
) -> Result<MakeRustlsConnect, StoreError> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match (mode, root_cert) {
        (SslMode::Disable, _) => unreachable!("no connector for sslmode=disable"),
        // libpq: without a root certificate, prefer and require encrypt
        // but do not authenticate the server.
        (SslMode::Prefer | SslMode::Require, RootCert::Unset) => {
            Arc::new(Unverified(provider.clone()))
        }
        // With one, require behaves as verify-ca (prefer too: libpq checks
        // the chain whenever it has a root certificate).
        (SslMode::Prefer | SslMode::Require | SslMode::VerifyCa, roots) => {
            Arc::new(ChainOnly(webpki(roots_from(roots)?, provider.clone())?))
        }
        (SslMode::VerifyFull, roots) => webpki(roots_from(roots)?, provider.clone())?,
    };
    let config = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(StoreError::config)?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth();
    Ok(MakeRustlsConnect::new(config))
}

fn webpki(
    roots: RootCertStore,
    provider: Arc<CryptoProvider>,
) -> Result<Arc<WebPkiServerVerifier>, StoreError> {
    WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider)
        .build()
        .map_err(StoreError::config)
}

fn roots_from(root_cert: &RootCert) -> Result<RootCertStore, StoreError> {
    let mut roots = RootCertStore::empty();
    match root_cert {
        RootCert::File(path) => {
            let shown = path.display();
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| StoreError::config(format!("sslrootcert={shown}: {e}")))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| StoreError::config(format!("sslrootcert={shown}: {e}")))?;
            let (added, _) = roots.add_parsable_certificates(certs);
            if added == 0 {
                return Err(StoreError::config(format!(
                    "sslrootcert={shown}: no usable PEM certificate in the file"
                )));
            }
        }
        RootCert::System | RootCert::Unset => {
            let found = rustls_native_certs::load_native_certs();
            roots.add_parsable_certificates(found.certs);
            if roots.is_empty() {
                return Err(StoreError::config(
                    "no trusted root certificates found on this system: give the server's CA with sslrootcert=PATH",
                ));
            }
        }
    }
    Ok(roots)
}

/// The cause of a failed first connection, in words, when it is TLS's.
pub(super) fn cause(e: &(dyn std::error::Error + 'static), mode: SslMode) -> Option<String> {
    let mut next = Some(e);
    while let Some(err) = next {
        if let Some(tls) = err.downcast_ref::<rustls::Error>() {
            return Some(describe(tls, mode));
        }
        next = match err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    None
}

fn describe(e: &rustls::Error, mode: SslMode) -> String {
    let rustls::Error::InvalidCertificate(cert) = e else {
        return format!("TLS handshake failed: {e}");
    };
    match cert {
        CertificateError::UnknownIssuer | CertificateError::BadSignature => format!(
            "unknown CA: the server's certificate does not chain to a root in sslrootcert \
             (or the system's roots), which sslmode={} checks",
            mode.name()
        ),
        CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. } => {
            "host name mismatch: the server's certificate does not name the host connected to \
             (sslmode=verify-full checks the name; verify-ca does not)"
                .to_owned()
        }
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            "the server's certificate has expired".to_owned()
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            "the server's certificate is not valid yet".to_owned()
        }
        other => format!("the server's certificate was refused: {other:?}"),
    }
}

/// `prefer`/`require` without `sslrootcert`: any certificate, but the
/// handshake's signatures are still checked (the session is encrypted with
/// whoever holds the certificate's key).
#[derive(Debug)]
struct Unverified(Arc<CryptoProvider>);

impl ServerCertVerifier for Unverified {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// `verify-ca`: the chain must lead to a trusted root; the name is not
/// checked. webpki checks the chain before the name, so a name error means
/// the chain passed.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp, now)
        {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}
