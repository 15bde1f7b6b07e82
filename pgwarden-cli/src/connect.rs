//! The connection: the URL (with `sslmode` and `sslrootcert` read here,
//! since tokio-postgres knows only `disable`, `prefer` and `require`), TLS
//! over rustls, and the pgwarden pool built on it.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::Duration;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
};
use tokio_postgres::config::{Host, SslMode as PgSslMode};
use tokio_postgres::tls::MakeTlsConnect;
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::Failure;

/// How long one connection attempt may take unless the URL says
/// (`connect_timeout`).
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// libpq's `sslmode` values (`allow` is read as `prefer`).
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum SslMode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl FromStr for SslMode {
    type Err = Failure;
    fn from_str(s: &str) -> Result<SslMode, Failure> {
        Ok(match s {
            "disable" => SslMode::Disable,
            "allow" | "prefer" => SslMode::Prefer,
            "require" => SslMode::Require,
            "verify-ca" => SslMode::VerifyCa,
            "verify-full" => SslMode::VerifyFull,
            _ => {
                return Err(Failure::usage(format!(
                    "invalid sslmode {s:?}: use disable, prefer, require, verify-ca or verify-full"
                )))
            }
        })
    }
}

/// A database URL taken apart: tokio-postgres's settings, and the TLS ones.
pub(crate) struct Target {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) ssl: SslMode,
    pub(crate) root_cert: Option<String>,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("ssl", &self.ssl)
            .field("root_cert", &self.root_cert)
            .finish_non_exhaustive()
    }
}

/// Reads a URL (`postgres://…?sslmode=…` or `host=… sslmode=…`). Without an
/// `sslmode`, `PGSSLMODE` is used, else `prefer` (libpq's default).
pub(crate) fn parse(url: &str) -> Result<Target, Failure> {
    let (rest, ssl, root_cert) = split_tls(url.trim())?;
    let mut config = tokio_postgres::Config::from_str(&rest)
        .map_err(|e| Failure::usage(format!("invalid database URL: {e}")))?;
    let ssl = match ssl.or_else(|| std::env::var("PGSSLMODE").ok()) {
        Some(s) => s.parse()?,
        None => SslMode::Prefer,
    };
    let root_cert = root_cert.or_else(|| std::env::var("PGSSLROOTCERT").ok());
    if config.get_connect_timeout().is_none() {
        config.connect_timeout(CONNECT_TIMEOUT);
    }
    if config.get_application_name().is_none() {
        config.application_name("pgwarden-cli");
    }
    // No TLS over a Unix socket (libpq ignores sslmode there too).
    let local = config
        .get_hosts()
        .iter()
        .all(|h| matches!(h, Host::Unix(_)))
        && !config.get_hosts().is_empty();
    config.ssl_mode(match ssl {
        _ if local => PgSslMode::Disable,
        SslMode::Disable => PgSslMode::Disable,
        SslMode::Prefer => PgSslMode::Prefer,
        _ => PgSslMode::Require,
    });
    Ok(Target {
        config,
        ssl,
        root_cert,
    })
}

/// Takes `sslmode` and `sslrootcert` out of a URL or a `key=value` string:
/// what is left, and their values.
fn split_tls(url: &str) -> Result<(String, Option<String>, Option<String>), Failure> {
    let (mut ssl, mut root) = (None, None);
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            return Ok((url.to_owned(), None, None));
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            match pair.split_once('=') {
                Some(("sslmode", v)) => ssl = Some(percent_decode(v)?),
                Some(("sslrootcert", v)) => root = Some(percent_decode(v)?),
                _ => kept.push(pair),
            }
        }
        let rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok((rest, ssl, root));
    }
    // key = value pairs; values may be 'quoted' with \ escapes.
    let mut kept = String::new();
    let mut chars = url.char_indices().peekable();
    while let Some(&(start, c)) = chars.peek() {
        if c.is_whitespace() {
            chars.next();
            continue;
        }
        let mut key = String::new();
        while let Some(&(_, c)) = chars.peek() {
            if c == '=' || c.is_whitespace() {
                break;
            }
            key.push(c);
            chars.next();
        }
        while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
            chars.next();
        }
        if chars.next().map(|(_, c)| c) != Some('=') {
            return Err(Failure::usage(format!(
                "invalid database URL: expected key=value after {key:?}"
            )));
        }
        while chars.peek().is_some_and(|&(_, c)| c.is_whitespace()) {
            chars.next();
        }
        let mut value = String::new();
        if chars.peek().is_some_and(|&(_, c)| c == '\'') {
            chars.next();
            loop {
                match chars.next() {
                    Some((_, '\\')) => value.extend(chars.next().map(|(_, c)| c)),
                    Some((_, '\'')) => break,
                    Some((_, c)) => value.push(c),
                    None => {
                        return Err(Failure::usage(
                            "invalid database URL: unterminated quoted value",
                        ))
                    }
                }
            }
        } else {
            while let Some(&(_, c)) = chars.peek() {
                if c.is_whitespace() {
                    break;
                }
                value.push(c);
                chars.next();
            }
        }
        let end = chars.peek().map_or(url.len(), |&(i, _)| i);
        match key.as_str() {
            "sslmode" => ssl = Some(value),
            "sslrootcert" => root = Some(value),
            _ => {
                kept.push_str(&url[start..end]);
                kept.push(' ');
            }
        }
    }
    Ok((kept.trim_end().to_owned(), ssl, root))
}

fn percent_decode(s: &str) -> Result<String, Failure> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'%' => {
                let hex = s
                    .get(i + 1..i + 3)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .ok_or_else(|| {
                        Failure::usage(format!("invalid database URL: bad %-escape in {s:?}"))
                    })?;
                out.push(hex);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out)
        .map_err(|_| Failure::usage(format!("invalid database URL: {s:?} is not UTF-8")))
}

/// The TLS connector for `target`'s `sslmode`: no check of the server's
/// certificate for `prefer` and `require` (libpq's behaviour, unless a root
/// certificate is named: then as `verify-ca`), the chain for `verify-ca`,
/// the chain and the host name for `verify-full`. The roots are
/// `sslrootcert`'s (`system` for the platform's), else the platform's.
pub(crate) fn tls(target: &Target) -> Result<Tls, Failure> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Failure::usage(format!("TLS setup: {e}")))?;
    let verify = match target.ssl {
        SslMode::Disable => None,
        SslMode::Prefer | SslMode::Require => target.root_cert.as_ref().map(|_| false),
        SslMode::VerifyCa => Some(false),
        SslMode::VerifyFull => Some(true),
    };
    let config = match verify {
        None => builder
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(NoVerify(provider)))
            .with_no_client_auth(),
        Some(full) => {
            let roots = Arc::new(roots(target.root_cert.as_deref())?);
            let webpki = WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| Failure::usage(format!("TLS setup: {e}")))?;
            if full {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder
                    .dangerous()
                    .with_custom_certificate_verifier(Arc::new(ChainOnly(webpki)))
                    .with_no_client_auth()
            }
        }
    };
    Ok(Tls(MakeRustlsConnect::new(config)))
}

/// rustls's connector, which is also handed a Unix socket's path as the
/// host name (tokio-postgres asks for a connector before it knows whether
/// TLS will be used) and refuses it: a path gets a placeholder name, never
/// used (there is no TLS over a Unix socket).
#[derive(Clone)]
pub(crate) struct Tls(MakeRustlsConnect);

impl<S> MakeTlsConnect<S> for Tls
where
    MakeRustlsConnect: MakeTlsConnect<S>,
{
    type Stream = <MakeRustlsConnect as MakeTlsConnect<S>>::Stream;
    type TlsConnect = <MakeRustlsConnect as MakeTlsConnect<S>>::TlsConnect;
    type Error = <MakeRustlsConnect as MakeTlsConnect<S>>::Error;

    fn make_tls_connect(&mut self, domain: &str) -> Result<Self::TlsConnect, Self::Error> {
        let domain = if domain.is_empty() || domain.starts_with('/') || domain.starts_with('@') {
            "localhost"
        } else {
            domain
        };
        MakeTlsConnect::<S>::make_tls_connect(&mut self.0, domain)
    }
}

fn roots(root_cert: Option<&str>) -> Result<RootCertStore, Failure> {
    let mut store = RootCertStore::empty();
    match root_cert {
        Some(path) if path != "system" => {
            let certs = CertificateDer::pem_file_iter(path)
                .map_err(|e| Failure::usage(format!("sslrootcert {path}: {e}")))?
                .collect::<Result<Vec<_>, _>>()
                .map_err(|e| Failure::usage(format!("sslrootcert {path}: {e}")))?;
            if certs.is_empty() {
                return Err(Failure::usage(format!(
                    "sslrootcert {path}: no PEM certificate in it"
                )));
            }
            for c in certs {
                store
                    .add(c)
                    .map_err(|e| Failure::usage(format!("sslrootcert {path}: {e}")))?;
            }
        }
        _ => {
            let found = rustls_native_certs::load_native_certs();
            for c in found.certs {
                // A platform certificate rustls cannot read is skipped, as
                // libpq skips it.
                let _ = store.add(c);
            }
            if store.is_empty() {
                return Err(Failure::usage(
                    "no root certificates found on this system: name one with sslrootcert=FILE",
                ));
            }
        }
    }
    Ok(store)
}

/// `prefer` and `require` without a root certificate: encrypted, the
/// server's certificate unchecked (libpq does the same). The handshake's
/// signatures are still verified.
#[derive(Debug)]
struct NoVerify(Arc<CryptoProvider>);

impl ServerCertVerifier for NoVerify {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        verify_tls12_signature(
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
        verify_tls13_signature(
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

/// `verify-ca`: the chain must lead to a trusted root; the host name is
/// not checked.
#[derive(Debug)]
struct ChainOnly(Arc<WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self
            .0
            .verify_server_cert(end_entity, intermediates, server_name, ocsp_response, now)
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

/// Where `target` points, for headers: `user@host:port/dbname`.
pub(crate) fn place(target: &Target) -> String {
    let c = &target.config;
    let host = match c.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = c.get_ports().first().copied().unwrap_or(5432);
    format!(
        "{}@{host}:{port}/{}",
        c.get_user().unwrap_or("?"),
        c.get_dbname().or(c.get_user()).unwrap_or("?")
    )
}

fn url_escape(s: &str) -> String {
    let mut out = String::new();
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~".contains(&b) {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

/// The environment `run` gives its command: `DATABASE_URL` without the
/// password (the command finds it as libpq does: `PGPASSWORD`, the
/// password file).
pub(crate) fn child_env(target: &Target) -> Vec<(&'static str, String)> {
    let c = &target.config;
    let hosts: Vec<String> = c
        .get_hosts()
        .iter()
        .zip(c.get_ports().iter().chain(std::iter::repeat(&5432)))
        .map(|(h, p)| match h {
            Host::Tcp(h) if h.contains(':') => format!("[{h}]:{p}"),
            Host::Tcp(h) => format!("{}:{p}", url_escape(h)),
            Host::Unix(d) => format!("{}:{p}", url_escape(&d.display().to_string())),
        })
        .collect();
    let mut url = format!(
        "postgresql://{}@{}/{}",
        url_escape(c.get_user().unwrap_or_default()),
        hosts.join(","),
        url_escape(c.get_dbname().or(c.get_user()).unwrap_or_default())
    );
    let mut query = Vec::new();
    let mode = match target.ssl {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        SslMode::VerifyCa => "verify-ca",
        SslMode::VerifyFull => "verify-full",
    };
    query.push(format!("sslmode={mode}"));
    if let Some(r) = &target.root_cert {
        query.push(format!("sslrootcert={}", url_escape(r)));
    }
    url.push('?');
    url.push_str(&query.join("&"));
    vec![("DATABASE_URL", url)]
}

/// Connects once (the reachability check: a failure here is exit 69), then
/// builds the pool the commands use.
pub(crate) async fn pool(target: &Target) -> Result<pgwarden::Pool, Failure> {
    let tls = tls(target)?;
    let bound = target
        .config
        .get_connect_timeout()
        .copied()
        .unwrap_or(CONNECT_TIMEOUT);
    let probe = tokio::time::timeout(bound, target.config.connect(tls.clone())).await;
    match probe {
        Ok(Ok((client, conn))) => {
            drop(client);
            // Ends at once: its client is gone.
            let _ = conn.await;
        }
        Ok(Err(e)) => return Err(Failure::unreachable(pgwarden::Error::Db(e).to_string())),
        Err(_) => {
            return Err(Failure::unreachable(format!(
                "no answer from the database within {bound:?}"
            )))
        }
    }
    let manager = deadpool_postgres::Manager::from_config(
        target.config.clone(),
        tls,
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    let inner = deadpool_postgres::Pool::builder(manager)
        .max_size(4)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .map_err(|e| Failure::usage(format!("building the pool: {e}")))?;
    pgwarden::Pool::builder(inner)
        .name("pgwarden-cli")
        .build()
        .map_err(|e| Failure::usage(format!("building the pool: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_come_out_of_both_url_forms() {
        let (rest, ssl, root) = split_tls(
            "postgres://u@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fa%20b",
        )
        .unwrap();
        assert_eq!(rest, "postgres://u@h:5/db?application_name=x");
        assert_eq!(ssl.as_deref(), Some("verify-full"));
        assert_eq!(root.as_deref(), Some("/a b"));
        let (rest, ssl, root) =
            split_tls("host=h  sslmode = verify-ca dbname='my db' sslrootcert='/c\\'s.pem'")
                .unwrap();
        assert_eq!(rest, "host=h dbname='my db'");
        assert_eq!(ssl.as_deref(), Some("verify-ca"));
        assert_eq!(root.as_deref(), Some("/c's.pem"));
        assert!(split_tls("host=h dbname='x").is_err());
        assert!(split_tls("host").is_err());
        assert!("verify".parse::<SslMode>().is_err());
        assert_eq!("allow".parse::<SslMode>().unwrap(), SslMode::Prefer);
    }
}
