//! Credentials: a server that requires a user and password, a token, or an nkey accepts the
//! right one and refuses a wrong or missing one at once, with [`ConnectError::Refused`] (not
//! retried as unreachable), and no error shows the password or token.

use std::time::Duration;

use kvroute_nats::testing::NatsServer;
use kvroute_nats::{ConnectError, Nats, NatsConfig};

use crate::run;

fn with_userinfo(url: &str, userinfo: &str) -> String {
    url.replacen("nats://", &format!("nats://{userinfo}@"), 1)
}

async fn connect(config: NatsConfig) -> Result<Nats, ConnectError> {
    let started = std::time::Instant::now();
    let result = Nats::connect(&NatsConfig {
        connect_timeout: Duration::from_secs(5),
        ..config
    })
    .await;
    // A refusal is answered at once, never waited out.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    result
}

fn refused(result: Result<Nats, ConnectError>, secret: &str) {
    match result {
        Err(error @ ConnectError::Refused { .. }) => {
            let text = error.to_string();
            assert!(text.contains("refused the connection"), "{text}");
            assert!(!text.contains(secret), "the secret is in the error: {text}");
        }
        Err(other) => panic!("expected a refusal, got {other}"),
        Ok(_) => panic!("connected without the right credentials"),
    }
}

#[test]
fn a_user_and_password_in_the_url_are_sent_and_a_wrong_one_is_refused_at_once() {
    run(async {
        let server = NatsServer::start_with(&["--user", "router", "--pass", "p@ss:w0rd"]);
        let url = server.url();
        // Special characters are percent-encoded in a URL.
        let nats = connect(NatsConfig::new(with_userinfo(&url, "router:p%40ss%3Aw0rd")))
            .await
            .expect("the right password");
        assert!(nats.status().connected());
        refused(
            connect(NatsConfig::new(with_userinfo(&url, "router:guess"))).await,
            "guess",
        );
        refused(connect(NatsConfig::new(url.clone())).await, "p@ss");
    });
}

#[test]
fn a_token_in_the_url_is_sent() {
    run(async {
        let server = NatsServer::start_with(&["--auth", "s3cr3t-token"]);
        let url = server.url();
        connect(NatsConfig::new(with_userinfo(&url, "s3cr3t-token")))
            .await
            .expect("the right token");
        refused(
            connect(NatsConfig::new(with_userinfo(&url, "wrong-token"))).await,
            "wrong-token",
        );
    });
}

#[test]
fn an_nkey_seed_file_authenticates_and_another_key_is_refused() {
    run(async {
        let user = nkeys::KeyPair::new_user();
        let dir = std::env::temp_dir().join(format!("kvroute-nats-nkey-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let conf = dir.join("server.conf");
        std::fs::write(
            &conf,
            format!(
                "authorization {{ users = [ {{ nkey: {} }} ] }}\n",
                user.public_key()
            ),
        )
        .unwrap();
        let server = NatsServer::start_with(&["-c", conf.to_str().unwrap()]);
        let seed = dir.join("user.nk");
        std::fs::write(&seed, format!("{}\n", user.seed().unwrap())).unwrap();
        let config = NatsConfig {
            nkey_file: Some(seed.clone()),
            ..NatsConfig::new(server.url())
        };
        connect(config).await.expect("the listed nkey");

        let stranger = dir.join("stranger.nk");
        let other = nkeys::KeyPair::new_user();
        std::fs::write(&stranger, other.seed().unwrap()).unwrap();
        refused(
            connect(NatsConfig {
                nkey_file: Some(stranger),
                ..NatsConfig::new(server.url())
            })
            .await,
            &other.seed().unwrap(),
        );
        let missing = connect(NatsConfig {
            nkey_file: Some(dir.join("absent.nk")),
            ..NatsConfig::new(server.url())
        })
        .await;
        assert!(
            matches!(&missing, Err(ConnectError::Credentials { .. })),
            "{:?}",
            missing.err()
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}

/// A CA and a server certificate for 127.0.0.1 signed by it; returns (CA, cert, key) paths.
fn pki(dir: &std::path::Path, tag: &str) -> (String, String, String) {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&key, &issuer)
        .unwrap();
    let path = |f: &str| dir.join(format!("{tag}-{f}")).to_str().unwrap().to_owned();
    let paths = (path("ca.pem"), path("cert.pem"), path("key.pem"));
    std::fs::write(&paths.0, ca.pem()).unwrap();
    std::fs::write(&paths.1, cert.pem()).unwrap();
    std::fs::write(&paths.2, key.serialize_pem()).unwrap();
    paths
}

#[test]
fn tls_with_the_servers_ca_connects_and_another_ca_fails_at_once() {
    run(async {
        let dir = std::env::temp_dir().join(format!("kvroute-nats-tls-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (ca, cert, key) = pki(&dir, "server");
        let (other_ca, _, _) = pki(&dir, "other");
        let server = NatsServer::start_with(&["--tls", "--tlscert", &cert, "--tlskey", &key]);
        let nats = connect(NatsConfig {
            tls_ca: Some(ca.into()),
            ..NatsConfig::new(server.url())
        })
        .await
        .expect("TLS with the server's CA");
        assert!(nats.status().connected());
        let wrong = connect(NatsConfig {
            tls_ca: Some(other_ca.into()),
            ..NatsConfig::new(server.url())
        })
        .await;
        assert!(
            matches!(&wrong, Err(ConnectError::Tls { .. })),
            "{:?}",
            wrong.err().map(|e| e.to_string())
        );
        let _ = std::fs::remove_dir_all(&dir);
    });
}
