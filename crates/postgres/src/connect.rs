//! The connection URL: libpq's TLS parameters (`sslmode`, `sslrootcert`)
//! read with libpq's meanings, the pool's connector chosen from them, and
//! start-up errors that name their cause.
//!
//! tokio-postgres itself knows only `sslmode=disable|prefer|require` and no
//! `sslrootcert`, so both are taken out of the URL here and the rest (hosts,
//! `target_session_attrs`, keepalives, ...) is left to tokio-postgres.
//!
//! ```no_run
//! # async fn run() -> Result<(), tower_idempotency::StoreError> {
//! // TLS with the chain checked against the provider's CA and the host name
//! // checked against the certificate (needs the `tls` feature).
//! let url = "postgres://app@db.example.com/app?sslmode=verify-full&sslrootcert=/etc/ca.pem";
//! let store = tower_idempotency_postgres::PostgresStore::open(url).await?;
//! # Ok(()) }
//! ```

use std::path::PathBuf;
use std::str::FromStr;

use deadpool_postgres::{Manager, ManagerConfig, RecyclingMethod};

use super::sslmode::{RootCert, SslMode};
use tower_idempotency::store::StoreError;

/// A URL taken apart: what tokio-postgres reads, and the TLS parameters.
pub(super) struct Target {
    pub(super) config: tokio_postgres::Config,
    pub(super) mode: SslMode,
    pub(super) root_cert: RootCert,
}

/// Splits `sslmode` and `sslrootcert` off a `postgres://` or
/// `postgresql://` URL (other forms are left to tokio-postgres whole).
pub(super) fn parse(url: &str) -> Result<Target, StoreError> {
    let mut mode = SslMode::Prefer;
    let mut root_cert = RootCert::Unset;
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let rest = match url.split_once('?') {
        Some((base, query)) if is_url => {
            let mut kept: Vec<String> = Vec::new();
            let mut renamed: Vec<String> = Vec::new();
            for pair in query.split('&').filter(|p| !p.is_empty()) {
                let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
                match name {
                    "sslmode" => mode = SslMode::parse(&percent_decode(value)?)?,
                    "sslrootcert" => {
                        let value = percent_decode(value)?;
                        root_cert = match value.as_str() {
                            "" => RootCert::Unset,
                            "system" => RootCert::System,
                            path => RootCert::File(PathBuf::from(path)),
                        };
                    }
                    // libpq's name; tokio-postgres calls it keepalives_retries.
                    "keepalives_count" => renamed.push(format!("keepalives_retries={value}")),
                    _ => kept.push(pair.to_owned()),
                }
            }
            kept.append(&mut renamed);
            if kept.is_empty() {
                base.to_owned()
            } else {
                format!("{base}?{}", kept.join("&"))
            }
        }
        _ => url.to_owned(),
    };
    let mut config = tokio_postgres::Config::from_str(&rest).map_err(StoreError::config)?;
    config.ssl_mode(match mode {
        SslMode::Disable => tokio_postgres::config::SslMode::Disable,
        SslMode::Prefer => tokio_postgres::config::SslMode::Prefer,
        _ => tokio_postgres::config::SslMode::Require,
    });
    Ok(Target {
        config,
        mode,
        root_cert,
    })
}

/// `%XX` escapes in a query value (a path may carry them).
fn percent_decode(value: &str) -> Result<String, StoreError> {
    let bytes = value.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = value
                .get(i + 1..i + 3)
                .and_then(|h| u8::from_str_radix(h, 16).ok())
                .ok_or_else(|| {
                    StoreError::config(format!("bad percent escape in URL value {value:?}"))
                })?;
            out.push(hex);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out)
        .map_err(|_| StoreError::config(format!("URL value {value:?} is not UTF-8")))
}

/// The pool's connection manager for `target`, with a TLS connector when the
/// URL asks for TLS.
///
/// # Errors
///
/// [`StoreError::Config`]: TLS asked for (`sslmode=require|verify-ca|
/// verify-full`, or `sslrootcert`) in a build without the `postgres-tls`
/// feature (never a silent fall-back to plain text), or roots that cannot
/// be read.
pub(super) fn manager(target: &Target) -> Result<Manager, StoreError> {
    let manager_config = ManagerConfig {
        recycling_method: RecyclingMethod::Fast,
    };
    let config = target.config.clone();
    if target.mode == SslMode::Disable {
        return Ok(Manager::from_config(
            config,
            tokio_postgres::NoTls,
            manager_config,
        ));
    }
    #[cfg(feature = "tls")]
    {
        let connector = super::tls::connector(target.mode, &target.root_cert)?;
        Ok(Manager::from_config(config, connector, manager_config))
    }
    #[cfg(not(feature = "tls"))]
    {
        if target.mode.needs_tls() || target.root_cert != RootCert::Unset {
            return Err(StoreError::config(format!(
                "the URL asks for TLS (sslmode={}{}), but this build has no PostgreSQL TLS: \
                 enable the `tls` feature of tower-idempotency",
                target.mode.name(),
                if target.root_cert == RootCert::Unset {
                    ""
                } else {
                    ", sslrootcert"
                }
            )));
        }
        // `prefer` without a TLS stack: plain text, as libpq built without
        // SSL support does.
        Ok(Manager::from_config(
            config,
            tokio_postgres::NoTls,
            manager_config,
        ))
    }
}

/// The first connection failed: an error that says why, in words (the
/// certificate's fault, the host name, a server without TLS), followed by
/// the chain of underlying errors.
pub(super) fn startup_error(target: &Target, e: deadpool_postgres::PoolError) -> StoreError {
    let chain = error_chain(&e);
    let joined = chain.join(": ");
    #[cfg(feature = "tls")]
    let cause = super::tls::cause(&e, target.mode);
    #[cfg(not(feature = "tls"))]
    let cause: Option<String> = None;
    let cause = cause.or_else(|| {
        joined.contains("server does not support TLS").then(|| {
            format!(
                "the server does not support TLS, and sslmode={} requires it",
                target.mode.name()
            )
        })
    });
    StoreError::unavailable(match cause {
        Some(cause) => format!("cannot connect to PostgreSQL: {cause} ({joined})"),
        None => format!("cannot connect to PostgreSQL: {joined}"),
    })
}

/// The messages of `e` and its sources, outermost first; an `io::Error`'s
/// own inner error is included (its `source` skips it).
pub(super) fn error_chain(e: &(dyn std::error::Error + 'static)) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut next = Some(e);
    while let Some(err) = next {
        let text = err.to_string();
        // tokio-postgres repeats its source's text after its own ("db
        // error: FATAL ..."): keep the fuller one.
        match out.last_mut() {
            Some(last) if text.starts_with(last.as_str()) || text == *last => *last = text,
            Some(last) if last.ends_with(&text) => {}
            _ => out.push(text),
        }
        next = match err
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
        {
            Some(inner) => Some(inner as &(dyn std::error::Error + 'static)),
            None => err.source(),
        };
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_parameters_are_taken_out_and_the_rest_kept() {
        let t = parse(
            "postgres://u@a:5433,b:5434/db?sslmode=verify-full&target_session_attrs=read-write&sslrootcert=/tmp/ca%20x.pem&keepalives_count=3",
        )
        .unwrap();
        assert_eq!(t.mode, SslMode::VerifyFull);
        assert_eq!(t.root_cert, RootCert::File(PathBuf::from("/tmp/ca x.pem")));
        assert_eq!(t.config.get_hosts().len(), 2);
        assert_eq!(t.config.get_keepalives_retries(), Some(3));
        assert_eq!(t.config.get_ports(), &[5433, 5434]);
        assert_eq!(
            t.config.get_target_session_attrs(),
            tokio_postgres::config::TargetSessionAttrs::ReadWrite
        );
        assert_eq!(
            t.config.get_ssl_mode(),
            tokio_postgres::config::SslMode::Require
        );
    }

    #[test]
    fn absent_sslmode_is_prefer_and_bad_values_are_config_errors() {
        let t = parse("postgres://u@h/db").unwrap();
        assert_eq!((t.mode, t.root_cert), (SslMode::Prefer, RootCert::Unset));
        for bad in [
            "postgres://u@h/db?sslmode=verify",
            "postgres://u@h/db?sslrootcert=%zz",
        ] {
            assert!(matches!(parse(bad), Err(StoreError::Config(_))), "{bad}");
        }
    }

    #[cfg(not(feature = "tls"))]
    #[test]
    fn without_the_feature_a_url_asking_for_tls_is_refused() {
        for url in [
            "postgres://u@h/db?sslmode=require",
            "postgres://u@h/db?sslmode=verify-ca",
            "postgres://u@h/db?sslmode=verify-full",
            "postgres://u@h/db?sslrootcert=/ca.pem",
        ] {
            let Err(StoreError::Config(e)) = manager(&parse(url).unwrap()) else {
                panic!("{url} must be refused");
            };
            assert!(e.to_string().contains("`tls` feature"), "{e}");
        }
        assert!(manager(&parse("postgres://u@h/db?sslmode=prefer").unwrap()).is_ok());
    }
}
