//! Mutual TLS on the request plane: a worker and a router holding certificates of the fleet's
//! CA talk; a client without TLS, or with a certificate of another CA, is refused, and so is a
//! worker whose certificate does not name its address.

use kvroute_runtime::{Client, ClientConfig, FleetTls, RequestError, WorkerServerConfig};

use crate::support::{Item, Job, collect, start_worker_with};

/// A CA and, signed by it, a certificate for each of `names` (its SANs), written under `dir`;
/// returns the [`FleetTls`] of each.
fn fleet(dir: &std::path::Path, tag: &str, names: &[&[&str]]) -> Vec<FleetTls> {
    use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
    std::fs::create_dir_all(dir).unwrap();
    let ca_key = KeyPair::generate().unwrap();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let ca = ca_params.self_signed(&ca_key).unwrap();
    let ca_path = dir.join(format!("{tag}-ca.pem"));
    std::fs::write(&ca_path, ca.pem()).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    names
        .iter()
        .enumerate()
        .map(|(i, sans)| {
            let key = KeyPair::generate().unwrap();
            let sans: Vec<String> = sans.iter().map(|s| (*s).to_owned()).collect();
            let cert = CertificateParams::new(sans)
                .unwrap()
                .signed_by(&key, &issuer)
                .unwrap();
            let (cert_path, key_path) = (
                dir.join(format!("{tag}-{i}.pem")),
                dir.join(format!("{tag}-{i}.key")),
            );
            std::fs::write(&cert_path, cert.pem()).unwrap();
            std::fs::write(&key_path, key.serialize_pem()).unwrap();
            FleetTls::load(&ca_path, &cert_path, &key_path).unwrap()
        })
        .collect()
}

fn client(tls: Option<FleetTls>) -> ClientConfig {
    ClientConfig {
        tls,
        ..ClientConfig::default()
    }
}

async fn served(addr: &str, config: ClientConfig) -> Result<usize, RequestError> {
    let client = Client::<Job, Item>::connect(addr, config).await?;
    let stream = client.generate("r", &Job::new(2)).await?;
    Ok(collect(stream).await.len())
}

#[tokio::test]
async fn only_peers_with_certificates_of_the_fleet_ca_talk() {
    let dir = std::env::temp_dir().join(format!("kvroute-fleet-tls-{}", std::process::id()));
    let ours = fleet(&dir, "ours", &[&["127.0.0.1", "localhost"], &["router"]]);
    let (worker_tls, router_tls) = (ours[0].clone(), ours[1].clone());
    let theirs = fleet(&dir, "theirs", &[&["127.0.0.1"]]);
    let (server, _engine) =
        start_worker_with(WorkerServerConfig::new(1).with_tls(Some(worker_tls.clone()))).await;
    let addr = server.local_addr().to_string();

    assert_eq!(
        served(&addr, client(Some(router_tls.clone())))
            .await
            .unwrap(),
        2
    );
    let err = served(&addr, client(None)).await.unwrap_err();
    assert!(
        matches!(&err, RequestError::Handshake { message, .. } if message.contains("over TLS only")),
        "plain TCP is refused with the reason: {err}"
    );
    let err = served(&addr, client(Some(theirs[0].clone())))
        .await
        .unwrap_err();
    assert!(err.to_string().contains("TLS"), "{err}");

    // Rotation: the worker's files now hold the other CA and a certificate of it; after a
    // reload new connections need that CA, and the old one is refused.
    for (from, to) in [
        ("theirs-ca.pem", "ours-ca.pem"),
        ("theirs-0.pem", "ours-0.pem"),
        ("theirs-0.key", "ours-0.key"),
    ] {
        std::fs::copy(dir.join(from), dir.join(to)).unwrap();
    }
    worker_tls.reload().unwrap();
    assert_eq!(
        served(&addr, client(Some(theirs[0].clone())))
            .await
            .unwrap(),
        2
    );
    assert!(
        served(&addr, client(Some(router_tls.clone())))
            .await
            .is_err()
    );
    // A reload that fails keeps what is in use.
    std::fs::write(dir.join("ours-0.key"), "not a key").unwrap();
    assert!(worker_tls.reload().is_err());
    assert_eq!(
        served(&addr, client(Some(theirs[0].clone())))
            .await
            .unwrap(),
        2
    );

    // A worker whose certificate does not name the address it is reached at.
    let misnamed = fleet(&dir, "misnamed", &[&["worker.example"], &["router"]]);
    let (server, _engine) =
        start_worker_with(WorkerServerConfig::new(2).with_tls(Some(misnamed[0].clone()))).await;
    let err = served(
        &server.local_addr().to_string(),
        client(Some(misnamed[1].clone())),
    )
    .await
    .unwrap_err();
    assert!(err.to_string().contains("TLS"), "{err}");

    // A TLS client does not talk to a plain worker.
    let (plain, _engine) = start_worker_with(WorkerServerConfig::new(3)).await;
    assert!(
        served(&plain.local_addr().to_string(), client(Some(router_tls)))
            .await
            .is_err()
    );
    let _ = std::fs::remove_dir_all(&dir);
}
