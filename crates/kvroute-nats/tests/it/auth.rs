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
