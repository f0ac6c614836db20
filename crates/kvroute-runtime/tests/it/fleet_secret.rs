//! Fleet membership: with a fleet secret, a worker serves only clients that prove it and a
//! client talks only to workers that prove it; a registry accepts registrations only from
//! workers that prove it. The secret itself never crosses the wire.

use std::time::Duration;

use kvroute_runtime::{
    Client, ClientConfig, Discovery, FleetSecret, InProcessDiscovery, InstanceInfo, RegistryChecks,
    RegistryServer, RemoteDiscovery, RemoteDiscoveryConfig, RequestError, WorkerServerConfig,
};

use crate::support::{Item, Job, TestClient, collect, start_worker_with};

fn secret(s: &str) -> FleetSecret {
    FleetSecret::new(s.as_bytes()).unwrap()
}

fn with_secret(secret: Option<FleetSecret>) -> ClientConfig {
    ClientConfig {
        fleet_secret: secret,
        ..ClientConfig::default()
    }
}

async fn try_connect(addr: &str, config: ClientConfig) -> Result<TestClient, RequestError> {
    Client::<Job, Item>::connect(addr, config).await
}

/// The handshake failure's message, or a panic if the connection (or its first request) worked.
async fn refused(addr: &str, config: ClientConfig) -> String {
    match try_connect(addr, config).await {
        Err(RequestError::Handshake { message, .. }) => message,
        Err(other) => panic!("expected a handshake refusal, got {other}"),
        Ok(client) => match client.generate("r", &Job::new(1)).await {
            Err(e) => e.to_string(),
            Ok(stream) => {
                let items = futures::StreamExt::collect::<Vec<_>>(stream).await;
                assert!(
                    items.iter().any(Result::is_err),
                    "served without the secret: {items:?}"
                );
                "refused after connecting".to_owned()
            }
        },
    }
}

#[tokio::test]
async fn a_worker_with_the_secret_serves_only_clients_that_prove_it() {
    let fleet = secret("the-fleet-secret-0123456789");
    let (server, engine) =
        start_worker_with(WorkerServerConfig::new(1).with_fleet_secret(Some(fleet.clone()))).await;
    let addr = server.local_addr().to_string();

    let client = try_connect(&addr, with_secret(Some(fleet.clone())))
        .await
        .unwrap();
    let items = collect(client.generate("ok", &Job::new(3)).await.unwrap()).await;
    assert_eq!(items.len(), 3);

    let message = refused(&addr, with_secret(None)).await;
    assert!(message.contains("requires the fleet secret"), "{message}");
    let message = refused(
        &addr,
        with_secret(Some(secret("another-secret-0123456789"))),
    )
    .await;
    assert!(
        message.contains("did not prove the fleet secret"),
        "{message}"
    );
    assert_eq!(
        engine.started.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "only the request that proved the secret reached the engine"
    );
}

#[tokio::test]
async fn a_client_with_the_secret_sends_nothing_to_a_worker_without_it() {
    let (server, engine) = start_worker_with(WorkerServerConfig::new(1)).await;
    let addr = server.local_addr().to_string();
    let message = refused(
        &addr,
        with_secret(Some(secret("the-fleet-secret-0123456789"))),
    )
    .await;
    assert!(
        message.contains("holds none") && message.contains("nothing is sent"),
        "{message}"
    );
    assert_eq!(engine.started.load(std::sync::atomic::Ordering::SeqCst), 0);
    // Without secrets on either side, as before.
    let client = try_connect(&addr, with_secret(None)).await.unwrap();
    assert_eq!(
        collect(client.generate("ok", &Job::new(2)).await.unwrap())
            .await
            .len(),
        2
    );
}

#[tokio::test]
async fn a_registry_with_the_secret_refuses_workers_without_it() {
    let fleet = secret("the-fleet-secret-0123456789");
    let registry = RegistryServer::bind_with_checks(
        "127.0.0.1:0",
        InProcessDiscovery::new(Duration::from_secs(5)),
        RegistryChecks::default().with_fleet_secret(Some(fleet.clone())),
    )
    .await
    .unwrap();
    let addr = registry.local_addr().to_string();
    let config = |secret: Option<FleetSecret>| RemoteDiscoveryConfig {
        client: ClientConfig {
            fleet_secret: secret,
            ..RemoteDiscoveryConfig::default().client
        },
        retry_interval: Duration::from_millis(20),
    };
    let stranger = RemoteDiscovery::new(addr.clone(), config(None));
    let refused = stranger
        .register(InstanceInfo::new(7, "127.0.0.1:1", 16))
        .await;
    let message = refused
        .expect_err("a worker without the secret registers")
        .to_string();
    assert!(message.contains("fleet secret"), "{message}");
    assert!(registry.discovery().watch().borrow().is_empty());

    let member = RemoteDiscovery::new(addr, config(Some(fleet)));
    let _lease = member
        .register(InstanceInfo::new(1, "127.0.0.1:2", 16))
        .await
        .expect("a worker with the secret registers");
    assert!(registry.discovery().watch().borrow().contains_key(&1));
}
