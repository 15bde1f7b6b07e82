//! pgwarden's lease statements on a pool that talks TLS only (the server
//! refuses any other connection: `hostssl` only), against a throwaway
//! PostgreSQL with a self-signed certificate: a statement cut short is
//! cancelled on the server the way the pool's own connections go, with its
//! TLS. Before, the cancel request went out without TLS, failed on a pool
//! whose `sslmode` is `require`, and the statement went on waiting on the
//! server after its caller gave up (then took the lease nobody would use).
//!
//! Lives with the command line's tests: this crate has the TLS stack
//! (rustls, tokio-postgres-rustls, rcgen) as its dependencies already.

use std::sync::Arc;
use std::time::Duration;

use pgwarden_testing::{eventually, TestServer};
use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::{verify_tls12_signature, verify_tls13_signature, CryptoProvider};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{ClientConfig, DigitallySignedStruct, SignatureScheme};
use tokio_postgres::config::SslMode;

const S: Duration = Duration::from_secs(1);

/// Accepts the test server's self-signed certificate (what `sslmode=require`
/// does: encryption, no authentication of the server).
#[derive(Debug)]
struct AnyCert(Arc<CryptoProvider>);

impl ServerCertVerifier for AnyCert {
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

/// Backends of `app` waiting on a lock.
async fn waiting(admin: &tokio_postgres::Client, app: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
            &[&app],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dropped_acquisition_is_cancelled_on_a_tls_only_pool() {
    let key = rcgen::KeyPair::generate().unwrap();
    let cert = rcgen::CertificateParams::new(vec!["localhost".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    let hba = "local all all trust\nhostssl all all 127.0.0.1/32 trust\n";
    let server = tokio::task::spawn_blocking({
        let (c, k) = (cert.pem(), key.serialize_pem());
        move || {
            TestServer::start_local_with(
                &[("ssl", "on"), ("listen_addresses", "127.0.0.1")],
                &[
                    ("server.crt", c.as_bytes()),
                    ("server.key", k.as_bytes()),
                    ("pg_hba.conf", hba.as_bytes()),
                ],
            )
        }
    })
    .await
    .unwrap()
    .expect("a TLS server");
    let db = server.create_database().await.unwrap();
    // The test's own sessions: over the Unix socket.
    let admin = db.connect().await.unwrap();

    let app = "tls-pool";
    let mut cfg = tokio_postgres::Config::new();
    cfg.host("localhost")
        .hostaddr(std::net::IpAddr::from([127, 0, 0, 1]))
        .port(server.port())
        .user("postgres")
        .dbname(db.name())
        .ssl_mode(SslMode::Require)
        .application_name(app);
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .unwrap()
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AnyCert(provider)))
        .with_no_client_auth();
    let mgr = deadpool_postgres::Manager::from_config(
        cfg,
        tokio_postgres_rustls::MakeRustlsConnect::new(tls),
        deadpool_postgres::ManagerConfig {
            recycling_method: deadpool_postgres::RecyclingMethod::Fast,
        },
    );
    let inner = deadpool_postgres::Pool::builder(mgr)
        .max_size(4)
        .runtime(deadpool_postgres::Runtime::Tokio1)
        .build()
        .unwrap();
    let pool = pgwarden::Pool::builder(inner)
        .name(app)
        .pooler(pgwarden::PoolerMode::Direct) // a cancel can reach it
        .build()
        .unwrap();
    let leases = pgwarden::Leases::builder(&pool)
        .statement_timeout(30 * S)
        .build()
        .unwrap();
    leases.install().await.unwrap();

    // Another session inserts "first" and keeps its transaction open: an
    // acquisition of "first" waits on it (up to the statement timeout).
    let inserter = db.connect().await.unwrap();
    inserter
        .batch_execute(
            "BEGIN; INSERT INTO pgwarden_leases (name, holder, token, expires_at)
             VALUES ('first', 'inserter', nextval('pgwarden_leases_token_seq'), now() - interval '1 s')",
        )
        .await
        .unwrap();
    let opts = pgwarden::LeaseOptions::new(30 * S);
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        leases.acquire("first", &opts, None),
    )
    .await;
    assert!(gave_up.is_err(), "the acquisition waits on the insert");
    // Cancelled on the server: no backend of the pool waits any more,
    // while the insert still holds the row.
    eventually(10 * S, "the abandoned statement cancelled", || async {
        waiting(&admin, app).await == 0
    })
    .await;
    inserter.batch_execute("ROLLBACK").await.unwrap();
    // Nothing took "first": the statement was cancelled, not left to take
    // it once the insert went.
    let rows: i64 = admin
        .query_one(
            "SELECT count(*) FROM pgwarden_leases WHERE name = 'first' AND holder <> ''",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
}
