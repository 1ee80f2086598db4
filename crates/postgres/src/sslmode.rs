//! libpq's `sslmode` and `sslrootcert`, as the URL gives them: read by
//! `connect.rs`, acted on by `tls.rs`.

use std::path::PathBuf;

use tower_idempotency::store::StoreError;

/// libpq's `sslmode`. Absent means `prefer`, as in libpq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum SslMode {
    /// No TLS.
    Disable,
    /// TLS if the server offers it, else plain text.
    Prefer,
    /// TLS or no connection; the certificate is checked only when
    /// `sslrootcert` is given (then as `verify-ca`), as libpq does.
    Require,
    /// TLS; the chain must lead to a trusted root; any host name.
    VerifyCa,
    /// TLS; the chain must lead to a trusted root and name the host.
    VerifyFull,
}

impl SslMode {
    pub(super) fn parse(value: &str) -> Result<SslMode, StoreError> {
        Ok(match value {
            "disable" => SslMode::Disable,
            "prefer" | "allow" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            other => {
                return Err(StoreError::config(format!(
                    "sslmode={other:?} is not one of disable, allow, prefer, require, verify-ca, verify-full"
                )));
            }
        })
    }

    pub(super) fn name(self) -> &'static str {
        match self {
            SslMode::Disable => "disable",
            SslMode::Prefer => "prefer",
            SslMode::Require => "require",
            SslMode::VerifyCa => "verify-ca",
            SslMode::VerifyFull => "verify-full",
        }
    }

    /// Whether the mode refuses a connection without TLS.
    #[cfg(not(feature = "tls"))]
    pub(super) fn needs_tls(self) -> bool {
        matches!(
            self,
            SslMode::Require | SslMode::VerifyCa | SslMode::VerifyFull
        )
    }
}

/// Where the CA certificates come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) enum RootCert {
    /// `sslrootcert` absent.
    Unset,
    /// `sslrootcert=system`: the operating system's trusted roots.
    System,
    /// `sslrootcert=PATH`: the PEM certificates in that file, and only them.
    File(PathBuf),
}
