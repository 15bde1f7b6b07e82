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
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::ParsedCertificate;
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

impl Target {
    /// For `run` and `revoke`, which write: with several hosts and no
    /// `target_session_attrs`, the one that takes writes (`read-write`),
    /// where libpq would keep the first that answers.
    pub(crate) fn need_writes(&mut self) {
        let hosts = self.config.get_hosts().len();
        if self.attrs.is_none() && hosts.max(self.config.get_hostaddrs().len()) > 1 {
            self.attrs = Some(Attrs::ReadWrite);
            self.implied = true;
        }
    }
}

/// libpq's `target_session_attrs`: which of the listed servers to keep.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) enum Attrs {
    Any,
    ReadWrite,
    ReadOnly,
    Primary,
    Standby,
    PreferStandby,
}

impl FromStr for Attrs {
    type Err = Failure;
    fn from_str(s: &str) -> Result<Attrs, Failure> {
        Ok(match s {
            "any" => Attrs::Any,
            "read-write" => Attrs::ReadWrite,
            "read-only" => Attrs::ReadOnly,
            "primary" => Attrs::Primary,
            "standby" => Attrs::Standby,
            "prefer-standby" => Attrs::PreferStandby,
            _ => {
                return Err(Failure::usage(format!(
                    "invalid target_session_attrs {s:?}: use any, read-write, read-only, primary, standby or prefer-standby"
                )))
            }
        })
    }
}

impl Attrs {
    fn as_str(self) -> &'static str {
        match self {
            Attrs::Any => "any",
            Attrs::ReadWrite => "read-write",
            Attrs::ReadOnly => "read-only",
            Attrs::Primary => "primary",
            Attrs::Standby => "standby",
            Attrs::PreferStandby => "prefer-standby",
        }
    }

    /// Whether a server in this state is kept (libpq's rules: read-write
    /// is `transaction_read_only` off, which a hot standby and
    /// `default_transaction_read_only` both turn on; primary is not in
    /// recovery). `prefer-standby` keeps a standby here; a second pass
    /// takes any.
    fn accepts(self, standby: bool, read_only: bool) -> bool {
        match self {
            Attrs::Any => true,
            Attrs::ReadWrite => !read_only,
            Attrs::ReadOnly => read_only,
            Attrs::Primary => !standby,
            Attrs::Standby | Attrs::PreferStandby => standby,
        }
    }
}

/// A database URL taken apart: tokio-postgres's settings, and the TLS ones.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) ssl: SslMode,
    pub(crate) root_cert: Option<String>,
    /// The client certificate and its key (`sslcert`, `sslkey`).
    pub(crate) client_cert: Option<(String, String)>,
    /// Where a password was looked for and not found (for the message when
    /// the server asks for one): `None` when there is a password.
    pub(crate) no_password: Option<String>,
    /// `target_session_attrs` (else `PGTARGETSESSIONATTRS`), when given.
    pub(crate) attrs: Option<Attrs>,
    /// Every other setting the URL and the service gave, as given, for the
    /// command's `DATABASE_URL` (see [`child_env`]).
    pub(crate) pass_on: Vec<(String, String)>,
    /// The server [`pool`] chose among the hosts: a configuration naming
    /// that host only.
    pub(crate) chosen: Option<tokio_postgres::Config>,
    /// `attrs` is `read-write` because `run` or `revoke` writes, not given.
    pub(crate) implied: bool,
}

impl fmt::Debug for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Target")
            .field("ssl", &self.ssl)
            .field("root_cert", &self.root_cert)
            .field("client_cert", &self.client_cert)
            .finish_non_exhaustive()
    }
}

/// An environment variable, unset when empty (as libpq reads them).
fn env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.is_empty())
}

/// The settings libpq reads from the environment, when the URL gives none.
const PG_ENV: &[&str] = &["PGHOST", "PGHOSTADDR", "PGPORT", "PGUSER", "PGDATABASE"];

/// The user's home directory.
fn home() -> Option<std::path::PathBuf> {
    env("HOME").map(std::path::PathBuf::from)
}

/// The operating system user, libpq's default user name.
fn os_user() -> Option<String> {
    env("USER").or_else(|| env("LOGNAME")).or_else(|| {
        // SAFETY: getpwuid returns a pointer to static storage or null; the
        // name is copied at once.
        unsafe {
            let pw = libc::getpwuid(libc::geteuid());
            if pw.is_null() || (*pw).pw_name.is_null() {
                return None;
            }
            Some(
                std::ffi::CStr::from_ptr((*pw).pw_name)
                    .to_string_lossy()
                    .into_owned(),
            )
        }
    })
}

/// Reads a URL (`postgres://…?sslmode=…` or `host=… sslmode=…`), or none,
/// with libpq's environment for what it does not say: `PGHOST`, `PGPORT`,
/// `PGUSER`, `PGPASSWORD`, `PGDATABASE`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`,
/// `PGOPTIONS`, `PGTARGETSESSIONATTRS`, `PGSSLMODE` (else `prefer`),
/// `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`, and the password file
/// (`PGPASSFILE`, else `~/.pgpass`).
pub(crate) fn parse(url: Option<&str>) -> Result<Target, Failure> {
    let url = match url {
        Some(u) => u.trim().to_owned(),
        None if PG_ENV.iter().any(|k| env(k).is_some()) || env("PGSERVICE").is_some() => {
            String::new()
        }
        None => return Err(Failure::usage(
            "no database: pass --url URL, or set DATABASE_URL, PGSERVICE or libpq's PGHOST, PGDATABASE…",
        )),
    };
    let mut tls = split_tls(&url)?;
    // A service (`service=` in the URL, else PGSERVICE): its settings fill
    // in what the URL does not say, before the environment does (libpq's
    // order).
    if let Some(name) = tls.service.take().or_else(|| env("PGSERVICE")) {
        let found = crate::service::lookup(&name)?;
        apply_service(&mut tls, &name, found)?;
    }
    let mut config = if tls.rest.is_empty() {
        tokio_postgres::Config::new()
    } else {
        tokio_postgres::Config::from_str(&tls.rest)
            .map_err(|e| Failure::usage(format!("invalid database URL: {e}")))?
    };
    if config.get_hosts().is_empty() && config.get_hostaddrs().is_empty() {
        match env("PGHOST") {
            Some(hosts) => {
                for h in hosts.split(',') {
                    if h.starts_with('/') {
                        config.host_path(h);
                    } else {
                        config.host(h);
                    }
                }
            }
            None => {
                // libpq's default: the Unix socket directory.
                let dir = ["/var/run/postgresql", "/tmp"]
                    .into_iter()
                    .find(|d| std::path::Path::new(d).is_dir())
                    .unwrap_or("/tmp");
                config.host_path(dir);
            }
        }
        if let Some(addrs) = env("PGHOSTADDR") {
            for a in addrs.split(',') {
                let ip = a
                    .parse()
                    .map_err(|_| Failure::usage(format!("PGHOSTADDR {a:?}: not an IP address")))?;
                config.hostaddr(ip);
            }
        }
    }
    if config.get_ports().is_empty() {
        if let Some(p) = env("PGPORT") {
            for p in p.split(',') {
                let port = p
                    .parse()
                    .map_err(|_| Failure::usage(format!("PGPORT {p:?}: not a port number")))?;
                config.port(port);
            }
        }
    }
    if config.get_user().is_none() {
        match env("PGUSER").or_else(os_user) {
            Some(u) => config.user(&u),
            None => return Err(Failure::usage("no user: set PGUSER or user= in the URL")),
        };
    }
    if config.get_dbname().is_none() {
        if let Some(d) = env("PGDATABASE") {
            config.dbname(&d);
        }
    }
    let mut no_password = None;
    if config.get_password().is_none() {
        if let Some(p) = env("PGPASSWORD") {
            config.password(p);
        } else {
            match passfile_password(&config, tls.passfile.as_deref()) {
                Ok(p) => {
                    config.password(p);
                }
                Err(why) => no_password = Some(why),
            }
        }
    }
    if config.get_options().is_none() {
        if let Some(o) = env("PGOPTIONS") {
            config.options(&o);
        }
    }
    let attrs = match tls.attrs.take().or_else(|| env("PGTARGETSESSIONATTRS")) {
        Some(a) => Some(a.parse::<Attrs>()?),
        None => None,
    };
    if config.get_connect_timeout().is_none() {
        let t = match env("PGCONNECT_TIMEOUT") {
            // libpq: at least 2 s; 0 or less means none (here: the default).
            Some(t) => match t.parse::<i64>() {
                Ok(n) if n > 0 => Duration::from_secs(n.max(2) as u64),
                Ok(_) => CONNECT_TIMEOUT,
                Err(_) => {
                    return Err(Failure::usage(format!(
                        "PGCONNECT_TIMEOUT {t:?}: not a number of seconds"
                    )))
                }
            },
            None => CONNECT_TIMEOUT,
        };
        config.connect_timeout(t);
    }
    if config.get_application_name().is_none() {
        let name = env("PGAPPNAME")
            .or(tls.fallback_app.take())
            .unwrap_or_else(|| "pgwarden-cli".to_owned());
        config.application_name(&name);
    }
    let ssl = match tls.mode.or_else(|| env("PGSSLMODE")) {
        Some(s) => s.parse()?,
        None => SslMode::Prefer,
    };
    let root_cert = tls.root_cert.or_else(|| env("PGSSLROOTCERT"));
    let cert = tls.cert.or_else(|| env("PGSSLCERT"));
    let key = tls.key.or_else(|| env("PGSSLKEY"));
    let pg_dir = home().map(|h| h.join(".postgresql"));
    let default_file = |name: &str| {
        pg_dir
            .as_ref()
            .map(|d| d.join(name))
            .filter(|p| p.exists())
            .map(|p| p.display().to_string())
    };
    // No TLS over a Unix socket (libpq ignores sslmode there too).
    let local = config
        .get_hosts()
        .iter()
        .all(|h| matches!(h, Host::Unix(_)))
        && config.get_hostaddrs().is_empty()
        && !config.get_hosts().is_empty();
    // Without TLS, libpq reads none of the TLS files (sslcert may name one
    // that does not exist here).
    let no_tls = local || ssl == SslMode::Disable;
    let client_cert = match (cert, key) {
        _ if no_tls => None,
        (Some(c), Some(k)) => Some((c, k)),
        (Some(c), None) => Some((
            c,
            default_file("postgresql.key").ok_or_else(|| {
                Failure::usage("sslcert given without sslkey (and no ~/.postgresql/postgresql.key)")
            })?,
        )),
        (None, Some(_)) => return Err(Failure::usage("sslkey given without sslcert")),
        // libpq's defaults, used when both exist.
        (None, None) => default_file("postgresql.crt").zip(default_file("postgresql.key")),
    };
    config.ssl_mode(match ssl {
        _ if local => PgSslMode::Disable,
        SslMode::Disable => PgSslMode::Disable,
        SslMode::Prefer => PgSslMode::Prefer,
        _ => PgSslMode::Require,
    });
    // verify-ca and verify-full without sslrootcert: libpq's default file.
    let root_cert = match (root_cert, ssl) {
        (Some(r), _) => Some(r),
        (None, SslMode::VerifyCa | SslMode::VerifyFull) if !local => {
            let file = pg_dir.map(|d| d.join("root.crt"));
            match file.filter(|f| f.exists()) {
                Some(f) => Some(f.display().to_string()),
                None => {
                    return Err(Failure::usage(
                        "sslmode verify-ca/verify-full: no root certificate (~/.postgresql/root.crt does not exist): name one with sslrootcert=FILE, or sslrootcert=system for the platform's",
                    ))
                }
            }
        }
        (None, _) => None,
    };
    Ok(Target {
        config,
        ssl,
        root_cert,
        client_cert,
        no_password,
        attrs,
        pass_on: tls.pairs,
        chosen: None,
        implied: false,
    })
}

/// The password for `config` in the password file (`passfile`, else
/// `PGPASSFILE`, else `~/.pgpass`), as libpq finds it: the first line whose
/// host, port, database and user match (`*` matches any); ignored when the
/// file is readable by group or others. Else where it looked, for the
/// message should the server ask for a password.
fn passfile_password(
    config: &tokio_postgres::Config,
    named: Option<&str>,
) -> Result<String, String> {
    use std::os::unix::fs::PermissionsExt;
    let path = named
        .map(str::to_owned)
        .or_else(|| env("PGPASSFILE"))
        .map(std::path::PathBuf::from)
        .or_else(|| home().map(|h| h.join(".pgpass")))
        .ok_or("no password file (HOME is not set)")?;
    let shown = path.display();
    let meta = std::fs::metadata(&path).map_err(|e| format!("no password file {shown} ({e})"))?;
    if !meta.is_file() {
        return Err(format!("password file {shown} is not a plain file"));
    }
    if meta.permissions().mode() & 0o077 != 0 {
        say!(
            "pgwarden: warning: password file {shown} has group or world access; permissions should be u=rw (0600) or less: ignored"
        );
        return Err(format!(
            "password file {shown} ignored: it has group or world access (chmod 0600 {shown})"
        ));
    }
    let text = std::fs::read_to_string(&path)
        .map_err(|e| format!("password file {shown} unreadable ({e})"))?;
    let (host, local) = match config.get_hosts().first() {
        Some(Host::Tcp(h)) => (h.clone(), false),
        Some(Host::Unix(p)) => (p.display().to_string(), true),
        None => ("localhost".to_owned(), true),
    };
    let port = config
        .get_ports()
        .first()
        .copied()
        .unwrap_or(5432)
        .to_string();
    let user = config.get_user().unwrap_or_default();
    let db = config.get_dbname().unwrap_or(user);
    for line in text.lines() {
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let fields = pgpass_fields(line);
        let [h, p, d, u, pw] = fields.as_slice() else {
            continue;
        };
        let m = |pat: &str, v: &str| pat == "*" || pat == v;
        let host_ok = m(h, &host) || (local && h == "localhost");
        if host_ok && m(p, &port) && m(d, db) && m(u, user) {
            return Ok(pw.clone());
        }
    }
    Err(format!(
        "no line for {host}:{port}:{db}:{user} in password file {shown}"
    ))
}

/// Fills in what `tls` (the URL) does not say from service `name`'s
/// settings (libpq: the URL's win over the service's, which win over the
/// environment's).
fn apply_service(
    tls: &mut TlsParts,
    name: &str,
    found: crate::service::Found,
) -> Result<(), Failure> {
    let mut given = tls.keys.clone();
    if !tls.rest.is_empty() {
        let c = tokio_postgres::Config::from_str(&tls.rest)
            .map_err(|e| Failure::usage(format!("invalid database URL: {e}")))?;
        let set = [
            ("user", c.get_user().is_some()),
            ("password", c.get_password().is_some()),
            ("dbname", c.get_dbname().is_some()),
            ("host", !c.get_hosts().is_empty()),
            ("hostaddr", !c.get_hostaddrs().is_empty()),
            ("port", !c.get_ports().is_empty()),
        ];
        given.extend(set.iter().filter(|(_, s)| *s).map(|(k, _)| (*k).to_owned()));
    }
    let url_form = tls.rest.starts_with("postgres://") || tls.rest.starts_with("postgresql://");
    for s in found.settings {
        if !tls.pairs.iter().any(|(k, _)| *k == s.key) {
            tls.pairs.push((s.key.clone(), s.value.clone()));
        }
        let at = format!(
            "service {name:?} ({}, line {})",
            found.file.display(),
            s.line
        );
        let ours = tls
            .take_if(&s.key, s.value.clone(), true)
            .map_err(|e| Failure::usage(format!("{at}: {e}")))?;
        if ours || given.contains(&s.key) {
            continue;
        }
        let pair = format!("{}={}", s.key, kv_quote(&s.value));
        // The key and its value, checked as tokio-postgres reads them.
        tokio_postgres::Config::from_str(&pair).map_err(|e| {
            let why = std::error::Error::source(&e).map_or(e.to_string(), |c| c.to_string());
            Failure::usage(if why.starts_with("unknown option") {
                format!(
                    "{at}: {}: not a setting pgwarden supports (libpq's that tokio-postgres reads, and sslmode, sslrootcert, sslcert, sslkey, passfile)",
                    s.key
                )
            } else {
                format!("{at}: {}={}: {why}", s.key, s.value)
            })
        })?;
        if url_form {
            tls.rest
                .push(if tls.rest.contains('?') { '&' } else { '?' });
            tls.rest
                .push_str(&format!("{}={}", s.key, url_escape(&s.value)));
        } else {
            if !tls.rest.is_empty() {
                tls.rest.push(' ');
            }
            tls.rest.push_str(&pair);
        }
    }
    Ok(())
}

/// A value quoted for a `key=value` string.
fn kv_quote(v: &str) -> String {
    format!("'{}'", v.replace('\\', "\\\\").replace('\'', "\\'"))
}

/// A password file line's five fields (`:` separates, `\` escapes).
fn pgpass_fields(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => {
                if let (Some(n), Some(f)) = (chars.next(), fields.last_mut()) {
                    f.push(n);
                }
            }
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => {
                if let Some(f) = fields.last_mut() {
                    f.push(c);
                }
            }
        }
    }
    fields
}

/// A URL with the settings tokio-postgres does not read taken out: TLS,
/// `service`, `passfile`, `fallback_application_name`.
#[derive(Debug, Default)]
struct TlsParts {
    rest: String,
    mode: Option<String>,
    root_cert: Option<String>,
    cert: Option<String>,
    key: Option<String>,
    service: Option<String>,
    passfile: Option<String>,
    fallback_app: Option<String>,
    /// `target_session_attrs` (tokio-postgres knows only `any` and
    /// `read-write`: pgwarden chooses the server itself).
    attrs: Option<String>,
    /// Every key the URL's query or `key=value` string gave.
    keys: Vec<String>,
    /// Every `key=value` the URL's query, its `key=value` string or the
    /// service gave, in order (the command's `DATABASE_URL` is made of
    /// them).
    pairs: Vec<(String, String)>,
}

impl TlsParts {
    /// Takes `key=value` if it is one of ours; false otherwise. With
    /// `keep`, a value already there stays (a service's settings do not
    /// override the URL's).
    fn take(&mut self, key: &str, value: String) -> Result<bool, Failure> {
        self.take_if(key, value, false)
    }

    fn take_if(&mut self, key: &str, value: String, keep: bool) -> Result<bool, Failure> {
        let slot = match key {
            "sslmode" => &mut self.mode,
            "sslrootcert" => &mut self.root_cert,
            "sslcert" => &mut self.cert,
            "sslkey" => &mut self.key,
            "service" => &mut self.service,
            "passfile" => &mut self.passfile,
            "fallback_application_name" => &mut self.fallback_app,
            "target_session_attrs" => &mut self.attrs,
            // libpq's old spelling of sslmode=require.
            "requiressl" => {
                let mode = if value.starts_with('1') {
                    "require"
                } else {
                    "prefer"
                };
                return self.take_if("sslmode", mode.to_owned(), keep);
            }
            // No GSSAPI encryption here: allowed unless required.
            "gssencmode" if value == "require" => {
                return Err(Failure::usage(
                    "gssencmode=require: pgwarden has no GSSAPI encryption (use sslmode)",
                ))
            }
            // Settings of what pgwarden does not do (GSSAPI, compression,
            // the terminal): without effect here, as in libpq for most.
            "gssencmode" | "krbsrvname" | "gsslib" | "sslcompression" | "tty" => return Ok(true),
            _ => return Ok(false),
        };
        if !(keep && slot.is_some()) {
            *slot = Some(value);
        }
        Ok(true)
    }
}

/// Takes `sslmode`, `sslrootcert`, `sslcert` and `sslkey` out of a URL or
/// a `key=value` string.
fn split_tls(url: &str) -> Result<TlsParts, Failure> {
    let mut parts = TlsParts::default();
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let Some((base, query)) = url.split_once('?') else {
            parts.rest = url.to_owned();
            return Ok(parts);
        };
        let mut kept = Vec::new();
        for pair in query.split('&') {
            let taken = match pair.split_once('=') {
                Some((k, v)) => {
                    let v = percent_decode(v)?;
                    parts.keys.push(k.to_owned());
                    parts.pairs.push((k.to_owned(), v.clone()));
                    parts.take(k, v)?
                }
                None => false,
            };
            if !taken {
                kept.push(pair);
            }
        }
        parts.rest = if kept.is_empty() {
            base.to_owned()
        } else {
            format!("{base}?{}", kept.join("&"))
        };
        return Ok(parts);
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
        parts.keys.push(key.clone());
        parts.pairs.push((key.clone(), value.clone()));
        if !parts.take(&key, value)? {
            kept.push_str(&url[start..end]);
            kept.push(' ');
        }
    }
    parts.rest = kept.trim_end().to_owned();
    Ok(parts)
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
/// `sslrootcert`'s (`system` for the platform's; `~/.postgresql/root.crt`
/// by default). A self-signed server certificate that is itself the root
/// named is accepted (OpenSSL 3 marks such certificates `CA:TRUE`, which
/// webpki refuses as an end entity; libpq accepts them). The client
/// certificate is `sslcert`'s, with `sslkey`'s key.
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
    let verifier: Arc<dyn ServerCertVerifier> = match verify {
        None => Arc::new(NoVerify(provider)),
        Some(full) => {
            let (store, pinned) = roots(target.root_cert.as_deref())?;
            let webpki = WebPkiServerVerifier::builder_with_provider(Arc::new(store), provider)
                .build()
                .map_err(|e| Failure::usage(format!("TLS setup: {e}")))?;
            Arc::new(Verify {
                webpki,
                pinned,
                full,
            })
        }
    };
    let builder = builder
        .dangerous()
        .with_custom_certificate_verifier(verifier);
    let config = match &target.client_cert {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let certs = CertificateDer::pem_file_iter(cert)
                .and_then(|i| i.collect::<Result<Vec<_>, _>>())
                .map_err(|e| Failure::usage(format!("sslcert {cert}: {e}")))?;
            if certs.is_empty() {
                return Err(Failure::usage(format!(
                    "sslcert {cert}: no PEM certificate in it"
                )));
            }
            let key_der = PrivateKeyDer::from_pem_file(key)
                .map_err(|e| Failure::usage(format!("sslkey {key}: {e}")))?;
            // Not `with_client_auth_cert`: it parses the certificate as
            // webpki does and refuses a version 1 certificate, which
            // `openssl x509 -req` makes and the server accepts.
            let signer = rustls::crypto::ring::default_provider()
                .key_provider
                .load_private_key(key_der)
                .map_err(|e| Failure::usage(format!("sslkey {key}: {e}")))?;
            let certified = rustls::sign::CertifiedKey::new(certs, signer);
            builder.with_client_cert_resolver(Arc::new(rustls::sign::SingleCertAndKey::from(
                certified,
            )))
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

/// The trusted roots, and the certificates of the file named (a server
/// certificate found among them is trusted as is).
fn roots(
    root_cert: Option<&str>,
) -> Result<(RootCertStore, Vec<CertificateDer<'static>>), Failure> {
    let mut store = RootCertStore::empty();
    let mut pinned = Vec::new();
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
                // A certificate webpki cannot take as a trust anchor may
                // still be the server's own (pinned below).
                let _ = store.add(c.clone());
                pinned.push(c);
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
    Ok((store, pinned))
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

/// `verify-ca` (`full` false): the chain must lead to a trusted root, the
/// host name is not checked; `verify-full`: the host name too. A server
/// certificate that is one of the root file's certificates is trusted as
/// is (the self-signed certificate of PostgreSQL's docs).
#[derive(Debug)]
struct Verify {
    webpki: Arc<WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
    full: bool,
}

impl ServerCertVerifier for Verify {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let pinned = self
            .pinned
            .iter()
            .any(|p| p.as_ref() == end_entity.as_ref());
        let result = if pinned {
            if self.full {
                let parsed = ParsedCertificate::try_from(end_entity)?;
                rustls::client::verify_server_name(&parsed, server_name)
                    .map(|()| ServerCertVerified::assertion())
            } else {
                Ok(ServerCertVerified::assertion())
            }
        } else {
            self.webpki.verify_server_cert(
                end_entity,
                intermediates,
                server_name,
                ocsp_response,
                now,
            )
        };
        match result {
            Err(rustls::Error::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) if !self.full || cn_matches(end_entity, server_name) => {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// Where `target` points, for headers: `user@host:port/dbname`.
pub(crate) fn place(target: &Target) -> String {
    let c = target.chosen.as_ref().unwrap_or(&target.config);
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

/// Percent-encodes all but URL-safe characters.
pub(crate) fn url_escape(s: &str) -> String {
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

/// Settings the command's `DATABASE_URL` spells from the resolved
/// configuration (or leaves out: the password), not as given.
const RESOLVED: &[&str] = &[
    "host",
    "hostaddr",
    "port",
    "user",
    "dbname",
    "password",
    "sslmode",
    "requiressl",
    "sslrootcert",
    "sslcert",
    "sslkey",
    "service",
    "options",
    "target_session_attrs",
];

/// The environment `run` gives its command: `DATABASE_URL`, the server
/// as `run` reached it, with every libpq setting given (in the URL, the
/// service, the environment) but the password, which the command finds as
/// libpq does (`PGPASSWORD`, the password file, `passfile` kept): every
/// host and port, `hostaddr`, `sslmode`, `sslrootcert`, `sslcert` and
/// `sslkey`, `options`, `target_session_attrs` (`read-write` when `run`
/// chose the primary among several hosts by itself), `application_name`,
/// `connect_timeout`, keepalives… `service` is resolved into its settings.
pub(crate) fn child_env(target: &Target) -> Vec<(&'static str, String)> {
    let c = &target.config;
    let hosts: Vec<String> = c
        .get_hosts()
        .iter()
        .zip(
            c.get_ports()
                .iter()
                .chain(std::iter::repeat(c.get_ports().last().unwrap_or(&5432))),
        )
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
    let mut query: Vec<(&str, String)> = Vec::new();
    let addrs: Vec<String> = c.get_hostaddrs().iter().map(|a| a.to_string()).collect();
    if !addrs.is_empty() {
        query.push(("hostaddr", addrs.join(",")));
    }
    let mode = match target.ssl {
        SslMode::Disable => "disable",
        SslMode::Prefer => "prefer",
        SslMode::Require => "require",
        SslMode::VerifyCa => "verify-ca",
        SslMode::VerifyFull => "verify-full",
    };
    query.push(("sslmode", mode.to_owned()));
    if let Some(r) = &target.root_cert {
        query.push(("sslrootcert", r.clone()));
    }
    if let Some((cert, key)) = &target.client_cert {
        query.push(("sslcert", cert.clone()));
        query.push(("sslkey", key.clone()));
    }
    if let Some(o) = c.get_options() {
        query.push(("options", o.to_owned()));
    }
    if let Some(a) = target.attrs.filter(|a| *a != Attrs::Any) {
        query.push(("target_session_attrs", a.as_str().to_owned()));
    }
    // The rest as given, the last of a repeated key winning (as in libpq).
    for (i, (k, v)) in target.pass_on.iter().enumerate() {
        let later = target.pass_on[i + 1..].iter().any(|(l, _)| l == k);
        if !later && !RESOLVED.contains(&k.as_str()) {
            query.push((k.as_str(), v.clone()));
        }
    }
    let query: Vec<String> = query
        .iter()
        .map(|(k, v)| format!("{}={}", url_escape(k), url_escape(v)))
        .collect();
    url.push('?');
    url.push_str(&query.join("&"));
    vec![("DATABASE_URL", url)]
}

/// `url` with its `key` parameter set to `value` (replaced if there).
pub(crate) fn set_param(url: &str, key: &str, value: &str) -> String {
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut pairs: Vec<String> = query
        .split('&')
        .filter(|p| !p.is_empty() && p.split('=').next() != Some(key))
        .map(str::to_owned)
        .collect();
    pairs.push(format!("{}={}", url_escape(key), url_escape(value)));
    format!("{base}?{}", pairs.join("&"))
}

/// One DER element: (tag, contents, rest).
fn der(b: &[u8]) -> Option<(u8, &[u8], &[u8])> {
    let (&tag, b) = b.split_first()?;
    let (&first, mut b) = b.split_first()?;
    let len = if first < 0x80 {
        first as usize
    } else {
        let n = (first & 0x7f) as usize;
        if n == 0 || n > 4 || b.len() < n {
            return None;
        }
        let len = b[..n].iter().fold(0usize, |a, &x| a << 8 | x as usize);
        b = &b[n..];
        len
    };
    (b.len() >= len).then(|| (tag, &b[..len], &b[len..]))
}

/// libpq's rule for a certificate without a subjectAltName: its subject's
/// common name is the host name (`*.` matching one label).
fn cn_matches(cert: &CertificateDer<'_>, name: &ServerName<'_>) -> bool {
    const SAN: &[u8] = &[0x06, 0x03, 0x55, 0x1d, 0x11];
    const CN: &[u8] = &[0x06, 0x03, 0x55, 0x04, 0x03];
    let ServerName::DnsName(host) = name else {
        return false;
    };
    let host = host.as_ref().to_ascii_lowercase();
    let bytes = cert.as_ref();
    if bytes.windows(SAN.len()).any(|w| w == SAN) {
        return false; // the names are in the subjectAltName: webpki decided
    }
    // Certificate → TBSCertificate → [0] version?, serial, algorithm,
    // issuer, validity, subject.
    let subject = (|| {
        let (_, cert, _) = der(bytes)?;
        let (_, tbs, _) = der(cert)?;
        let (tag, _, after_first) = der(tbs)?;
        let rest = if tag == 0xa0 {
            der(after_first)?.2
        } else {
            after_first
        };
        let (_, _, rest) = der(rest)?; // algorithm
        let (_, _, rest) = der(rest)?; // issuer
        let (_, _, rest) = der(rest)?; // validity
        let (_, subject, _) = der(rest)?;
        Some(subject)
    })();
    let Some(mut rdns) = subject else {
        return false;
    };
    while let Some((_, set, rest)) = der(rdns) {
        rdns = rest;
        let Some((_, attr, _)) = der(set) else {
            continue;
        };
        let Some(value) = attr.strip_prefix(CN) else {
            continue;
        };
        let Some((_, value, _)) = der(value) else {
            continue;
        };
        let cn = String::from_utf8_lossy(value).to_ascii_lowercase();
        if cn == host {
            return true;
        }
        if let (Some(suffix), Some((label, rest))) = (cn.strip_prefix("*."), host.split_once('.')) {
            if !label.is_empty() && rest == suffix {
                return true;
            }
        }
    }
    false
}

/// A failed first connection: exit 69 (unreachable) when the server
/// could not be reached or cannot take connections now (starting up,
/// shutting down, too many connections); exit 1 when it answered with a
/// refusal that retrying will not change (a wrong password, an unknown role
/// or database, a refused certificate). The message names the server.
fn connect_failure(target: &Target, e: tokio_postgres::Error) -> Failure {
    let at = place(target);
    if let Some(db) = e.as_db_error() {
        let code = db.code().code();
        let transient = matches!(code, "57P03" | "57P01" | "57P02" | "53300" | "08006");
        let message = format!("{at}: {} ({code})", db.message());
        return if transient {
            Failure::unreachable(message)
        } else {
            Failure {
                code: 1,
                message: format!("cannot connect to {message}"),
            }
        };
    }
    // A TLS failure (a refused certificate) is not unreachability.
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(err) = source {
        let tls = err.downcast_ref::<rustls::Error>().or_else(|| {
            err.downcast_ref::<std::io::Error>()
                .and_then(|io| io.get_ref())
                .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        });
        if let Some(tls) = tls {
            return Failure {
                code: 1,
                message: format!("cannot connect to {at}: {}", tls_text(tls, target)),
            };
        }
        source = err.source();
    }
    // The error and its causes (tokio-postgres's `Display` shows only the
    // kind: "invalid configuration").
    let mut text = e.to_string();
    let mut cause = std::error::Error::source(&e);
    while let Some(c) = cause {
        text.push_str(&format!(": {c}"));
        cause = c.source();
    }
    // tokio-postgres reports a server without TLS under sslmode=require
    // this way: a configuration mismatch, not an outage.
    if text.contains("server does not support TLS") {
        return Failure {
            code: 1,
            message: format!("cannot connect to {at}: {text}"),
        };
    }
    // The server asked for a password and there is none: it was reached.
    if text.contains("password missing") {
        let user = target.config.get_user().unwrap_or("?");
        return Failure {
            code: 1,
            message: format!(
                "cannot connect to {at}: fe_sendauth: no password supplied (the server asks {user} for one; {}); hint: set PGPASSWORD, or add host:port:database:user:password to ~/.pgpass (or the file PGPASSFILE names) with mode 0600",
                target
                    .no_password
                    .as_deref()
                    .unwrap_or("none in the URL, PGPASSWORD or the password file")
            ),
        };
    }
    Failure::unreachable(format!("{at}: {}", pgwarden::Error::Db(e)))
}

/// A TLS failure as psql says it, in substance: what was wrong with which
/// certificate, and which file was trusted.
fn tls_text(e: &rustls::Error, target: &Target) -> String {
    let roots = match target.root_cert.as_deref() {
        Some("system") | None => "the system's trusted roots".to_owned(),
        Some(f) => f.to_owned(),
    };
    let verify = "certificate verify failed: the server's certificate";
    let cert = match e {
        rustls::Error::InvalidCertificate(c) => c,
        rustls::Error::AlertReceived(alert) => {
            return match &target.client_cert {
                Some((cert, _)) => format!(
                    "TLS: the server refused the handshake ({alert:?} alert): it does not accept the client certificate {cert} (not signed by a CA of its ssl_ca_file, or not for this user)"
                ),
                None => format!("TLS: the server refused the handshake ({alert:?} alert)"),
            };
        }
        other => return format!("TLS: {other}"),
    };
    match cert {
        CertificateError::UnknownIssuer => format!(
            "{verify} is not signed by a certificate authority in {roots} (unknown issuer): sslrootcert must name the CA that signed it"
        ),
        CertificateError::Other(o)
            if o.0.downcast_ref::<webpki::Error>() == Some(&webpki::Error::CaUsedAsEndEntity) =>
        {
            format!(
                "{verify} is a CA certificate (CA:TRUE, as OpenSSL makes self-signed ones) that is not in {roots} (unknown issuer): sslrootcert must name that certificate, or the CA that signed it"
            )
        }
        CertificateError::NotValidForName => format!(
            "{verify} does not name host {:?} (sslmode=verify-full checks the name)",
            host_name(target)
        ),
        CertificateError::NotValidForNameContext {
            expected,
            presented,
        } => format!(
            "{verify} is for {} and not for host {:?} (sslmode=verify-full checks the name)",
            if presented.is_empty() {
                "no host name in a subjectAltName (and its common name does not match)"
                    .to_owned()
            } else {
                presented.join(", ")
            },
            expected.to_str()
        ),
        CertificateError::Expired | CertificateError::ExpiredContext { .. } => {
            format!("{verify} has expired")
        }
        CertificateError::NotValidYet | CertificateError::NotValidYetContext { .. } => {
            format!("{verify} is not valid yet (check this machine's clock)")
        }
        CertificateError::Revoked => format!("{verify} has been revoked"),
        CertificateError::BadSignature => format!("{verify} has a bad signature"),
        CertificateError::InvalidPurpose | CertificateError::InvalidPurposeContext { .. } => {
            format!("{verify} is not for a TLS server (extended key usage)")
        }
        other => format!("{verify} was refused: {other}"),
    }
}

/// The first host name, for messages.
fn host_name(target: &Target) -> String {
    match target.config.get_hosts().first() {
        Some(Host::Tcp(h)) => h.clone(),
        Some(Host::Unix(p)) => p.display().to_string(),
        None => "localhost".to_owned(),
    }
}

/// What the first connection learned of the server.
#[derive(Copy, Clone, Debug, Default)]
pub(crate) struct Server {
    /// A hot standby (in recovery): advisory locks and lease writes are the
    /// primary's.
    pub(crate) standby: bool,
}

/// The configuration of host `i` of `c` alone (its `hostaddr` and port),
/// every other setting kept.
fn one_host(c: &tokio_postgres::Config, i: usize) -> tokio_postgres::Config {
    let mut one = tokio_postgres::Config::new();
    match c.get_hosts().get(i) {
        Some(Host::Tcp(h)) => {
            one.host(h);
        }
        Some(Host::Unix(p)) => {
            one.host_path(p);
        }
        None => {}
    }
    if let Some(a) = c.get_hostaddrs().get(i) {
        one.hostaddr(*a);
    }
    let ports = c.get_ports();
    if let Some(p) = ports.get(i).or(if ports.len() == 1 {
        ports.first()
    } else {
        None
    }) {
        one.port(*p);
    }
    if let Some(u) = c.get_user() {
        one.user(u);
    }
    if let Some(p) = c.get_password() {
        one.password(p);
    }
    if let Some(d) = c.get_dbname() {
        one.dbname(d);
    }
    if let Some(o) = c.get_options() {
        one.options(o);
    }
    if let Some(a) = c.get_application_name() {
        one.application_name(a);
    }
    if let Some(t) = c.get_connect_timeout() {
        one.connect_timeout(*t);
    }
    if let Some(t) = c.get_tcp_user_timeout() {
        one.tcp_user_timeout(*t);
    }
    one.ssl_mode(c.get_ssl_mode())
        .ssl_negotiation(c.get_ssl_negotiation())
        .keepalives(c.get_keepalives())
        .keepalives_idle(c.get_keepalives_idle())
        .channel_binding(c.get_channel_binding());
    if let Some(i) = c.get_keepalives_interval() {
        one.keepalives_interval(i);
    }
    if let Some(r) = c.get_keepalives_retries() {
        one.keepalives_retries(r);
    }
    one
}

/// One server reached: its state, or why not.
async fn probe(target: &Target, tls: &Tls) -> Result<(bool, bool), Failure> {
    let bound = target
        .config
        .get_connect_timeout()
        .copied()
        .unwrap_or(CONNECT_TIMEOUT);
    let probe = tokio::time::timeout(bound, async {
        let (client, conn) = target.config.connect(tls.clone()).await?;
        let task = tokio::spawn(conn);
        let rows = client
            .simple_query(
                "SELECT pg_is_in_recovery()::text, current_setting('transaction_read_only')",
            )
            .await;
        drop(client);
        // Ends at once: its client is gone.
        let _ = task.await;
        rows
    })
    .await;
    match probe {
        Ok(Ok(rows)) => {
            let (mut standby, mut read_only) = (false, false);
            for m in &rows {
                if let tokio_postgres::SimpleQueryMessage::Row(r) = m {
                    standby = r.get(0) == Some("true");
                    read_only = r.get(1) == Some("on");
                }
            }
            Ok((standby, read_only))
        }
        Ok(Err(e)) => Err(connect_failure(target, e)),
        Err(_) => Err(Failure::unreachable(format!(
            "{}: no answer within {} (PGCONNECT_TIMEOUT or connect_timeout sets the bound)",
            place(target),
            crate::format::human(bound)
        ))),
    }
}

/// Connects to the listed servers in turn, as libpq does, until one
/// connects and `target_session_attrs` keeps it (`prefer-standby`: a
/// standby, else, in a second round, any); asks it one question (the
/// reachability check: no answer within the connect timeout, a paused
/// PgBouncer included, is exit 69), then builds the pool the commands use
/// on that server alone ([`Target::chosen`]); `load_balance_hosts=random`
/// starts at a random host. None kept: exit 69 when one
/// could not be reached or was not of the kind asked for, else 1 (each
/// refused the login), naming each server.
pub(crate) async fn pool(target: &mut Target) -> Result<(pgwarden::Pool, Server), Failure> {
    let tls = tls(target)?;
    let attrs = target.attrs.unwrap_or(Attrs::Any);
    let n = target
        .config
        .get_hosts()
        .len()
        .max(target.config.get_hostaddrs().len());
    let mut failures: Vec<Failure> = Vec::new();
    let mut chosen = None;
    // load_balance_hosts=random: a random first host, the others in turn.
    let start = if target.config.get_load_balance_hosts()
        == tokio_postgres::config::LoadBalanceHosts::Random
    {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos() as usize);
        nanos % n.max(1)
    } else {
        0
    };
    'rounds: for round in [attrs, Attrs::Any] {
        // prefer-standby's second round: what it finds now is what counts.
        failures.clear();
        for k in 0..n.max(1) {
            let i = (start + k) % n.max(1);
            let mut one = target.clone();
            if n > 1 {
                one.config = one_host(&target.config, i);
            }
            match probe(&one, &tls).await {
                Ok((standby, read_only)) if round.accepts(standby, read_only) => {
                    chosen = Some((one.config, standby));
                    break 'rounds;
                }
                Ok((standby, _)) => failures.push(Failure::unreachable(format!(
                    "{}: {} (target_session_attrs={})",
                    place(&one),
                    if standby {
                        "a hot standby"
                    } else if attrs == Attrs::ReadOnly {
                        "a read-write server"
                    } else if attrs == Attrs::Standby {
                        "not a standby"
                    } else {
                        "a read-only session (default_transaction_read_only)"
                    },
                    attrs.as_str()
                ))),
                Err(f) => failures.push(f),
            }
        }
        if attrs != Attrs::PreferStandby {
            break;
        }
    }
    let Some((config, standby)) = chosen else {
        return Err(match failures.len() {
            1 => failures.remove(0),
            _ => {
                let code = if failures.iter().all(|f| f.code == 1) {
                    1
                } else {
                    crate::EXIT_UNREACHABLE
                };
                let each: Vec<String> = failures
                    .into_iter()
                    .map(|f| {
                        let m = f.message;
                        m.strip_prefix("database unreachable: ")
                            .map(str::to_owned)
                            .unwrap_or(m)
                    })
                    .collect();
                let kept = match (attrs, target.implied) {
                    (Attrs::Any, _) => String::new(),
                    (a, false) => format!(" (target_session_attrs={})", a.as_str()),
                    (a, true) => format!(
                        " (target_session_attrs={}: this command writes)",
                        a.as_str()
                    ),
                };
                let message = format!(
                    "none of the {n} servers listed was kept{kept}: {}",
                    each.join("; ")
                );
                if code == 1 {
                    Failure { code, message }
                } else {
                    Failure::unreachable(message)
                }
            }
        });
    };
    let server = Server { standby };
    target.chosen = Some(config.clone());
    let manager = deadpool_postgres::Manager::from_config(
        config,
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
    let pool = pgwarden::Pool::builder(inner)
        .name("pgwarden-cli")
        .build()
        .map_err(|e| Failure::usage(format!("building the pool: {e}")))?;
    Ok((pool, server))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tls_settings_come_out_of_both_url_forms() {
        let p = split_tls(
            "postgres://u@h:5/db?sslmode=verify-full&application_name=x&sslrootcert=%2Fa%20b&sslcert=c.pem&sslkey=k.pem",
        )
        .unwrap();
        assert_eq!(p.rest, "postgres://u@h:5/db?application_name=x");
        assert_eq!(p.mode.as_deref(), Some("verify-full"));
        assert_eq!(p.root_cert.as_deref(), Some("/a b"));
        assert_eq!(p.cert.as_deref(), Some("c.pem"));
        assert_eq!(p.key.as_deref(), Some("k.pem"));
        let p = split_tls("host=h  sslmode = verify-ca dbname='my db' sslrootcert='/c\\'s.pem'")
            .unwrap();
        assert_eq!(p.rest, "host=h dbname='my db'");
        assert_eq!(p.mode.as_deref(), Some("verify-ca"));
        assert_eq!(p.root_cert.as_deref(), Some("/c's.pem"));
        assert_eq!(
            pgpass_fields("h\\:x:5432:*:u:pa\\:ss:word"),
            ["h:x", "5432", "*", "u", "pa:ss:word"]
        );
        assert!(split_tls("host=h dbname='x").is_err());
        assert!(split_tls("host").is_err());
        assert!("verify".parse::<SslMode>().is_err());
        assert!("primary".parse::<Attrs>().is_ok());
        assert!("master".parse::<Attrs>().is_err());
        assert_eq!("allow".parse::<SslMode>().unwrap(), SslMode::Prefer);
    }

    #[test]
    fn the_commands_url_has_every_setting_but_the_password() {
        let t = parse(Some(
            "postgresql://u:secret@h1:5,h2:6/db?password=x&sslmode=disable&keepalives=0&application_name=a&application_name=b&target_session_attrs=primary&options=-c%20a%3Db",
        ))
        .unwrap();
        let url = child_env(&t).remove(0).1;
        assert!(
            !url.contains("secret") && !url.contains("password"),
            "{url}"
        );
        assert!(url.starts_with("postgresql://u@h1:5,h2:6/db?"), "{url}");
        for part in [
            "sslmode=disable",
            "keepalives=0",
            "application_name=b",
            "target_session_attrs=primary",
            "options=-c%20a%3Db",
        ] {
            assert!(url.contains(part), "{part} in {url}");
        }
        assert!(!url.contains("application_name=a"), "{url}");
        let url = set_param(&url, "application_name", "pgwarden run x");
        assert!(
            url.ends_with("&application_name=pgwarden%20run%20x"),
            "{url}"
        );
        assert_eq!(url.matches("application_name").count(), 1, "{url}");
        let t = parse(Some("host=h1,h2 port=5 user=u password='s p' dbname=d")).unwrap();
        let url = child_env(&t).remove(0).1;
        assert!(url.starts_with("postgresql://u@h1:5,h2:5/d?"), "{url}");
        assert!(!url.contains("s%20p"), "{url}");
    }
}
