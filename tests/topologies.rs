//! The Redis Cluster and Sentinel fixtures of `support::redis_topology`, checked against
//! the servers they start: they form, serve keys, reshard, fail over and come back.

#[macro_use]
mod support;

use std::time::{Duration, Instant};

use support::redis_topology::{RedisCluster, SentinelSet};

#[test]
#[ignore = "needs redis-server: scripts/test.sh"]
fn cluster_forms_serves_reshards_and_fails_over() {
    let started = Instant::now();
    let mut cluster = RedisCluster::start(3, 1);
    eprintln!(
        "cluster of 3 masters and 3 replicas up in {:?}",
        started.elapsed()
    );

    assert_eq!(cluster.urls().len(), 6);
    let masters = cluster.master_ports();
    assert_eq!(masters.len(), 3, "masters");
    assert_eq!(cluster.replica_ports().len(), 3, "replicas");
    assert_eq!(
        cluster.cli(masters[0], &["CONFIG", "GET", "appendonly"]),
        "appendonly\nno\n"
    );

    // A key lives on the master owning its slot; another master redirects.
    let key = "topology:key";
    let owner = cluster.master_for_key(key);
    assert!(masters.contains(&owner));
    assert_eq!(cluster.cli(owner, &["SET", key, "value"]).trim(), "OK");
    assert_eq!(cluster.cli(owner, &["GET", key]).trim(), "value");
    assert_eq!(cluster.keys_on(owner), 1);
    assert!(cluster.commandstats(owner).contains("cmdstat_set:calls=1,"));
    let other = *masters.iter().find(|&&port| port != owner).unwrap();
    let redirect = cluster.cli(other, &["GET", key]);
    assert!(
        redirect.starts_with("MOVED "),
        "GET on another master: {redirect}"
    );
    assert_eq!(cluster.keys_on(other), 0);

    // Resharding moves the lowest slots, with their keys, to the other master.
    let first_slot = lowest_slot(&cluster, owner);
    let moved = key_in_slot(first_slot);
    assert_eq!(
        cluster.cli(owner, &["CLUSTER", "KEYSLOT", &moved]).trim(),
        first_slot.to_string()
    );
    assert_eq!(cluster.cli(owner, &["SET", &moved, "moved"]).trim(), "OK");
    let started = Instant::now();
    cluster.reshard(owner, other, 10);
    eprintln!("10 slots resharded in {:?}", started.elapsed());
    assert_eq!(cluster.master_for_key(&moved), other);
    assert_eq!(cluster.cli(other, &["GET", &moved]).trim(), "moved");
    assert_eq!(cluster.keys_on(owner) + cluster.keys_on(other), 2);

    // Killing the master of `key` hands its slots to its replica, which has the key.
    let owner = cluster.master_for_key(key);
    cluster.wait_replicated(owner);
    let started = Instant::now();
    cluster.kill(owner);
    let promoted = cluster.wait_for_failover(owner);
    eprintln!("cluster failed over in {:?}", started.elapsed());
    assert_ne!(promoted, owner);
    assert_eq!(cluster.master_for_key(key), promoted);
    assert_eq!(cluster.cli(promoted, &["GET", key]).trim(), "value");
    assert_eq!(cluster.master_ports().len(), 3, "masters after failover");
    for port in cluster.master_ports() {
        let info = cluster.cli(port, &["CLUSTER", "INFO"]);
        assert!(info.contains("cluster_state:ok"), "port {port}:\n{info}");
    }

    // The killed master rejoins as a replica of the one that replaced it.
    let started = Instant::now();
    cluster.restart(owner);
    eprintln!("killed master rejoined in {:?}", started.elapsed());
    assert!(cluster.replica_ports().contains(&owner));
}

#[test]
#[ignore = "needs redis-server: scripts/test.sh"]
fn sentinel_set_forms_and_fails_over() {
    let started = Instant::now();
    let mut set = SentinelSet::start_with(true);
    eprintln!(
        "primary, replica and 3 sentinels up in {:?}",
        started.elapsed()
    );

    assert_eq!(set.master_name(), "idem");
    assert_eq!(set.sentinel_urls().len(), 3);
    let [primary, replica] = set.data_ports()[..] else {
        panic!("two data servers")
    };
    assert_eq!(set.primary_port(), primary);
    assert_eq!(
        set.cli(primary, &["CONFIG", "GET", "appendonly"]),
        "appendonly\nyes\n"
    );
    assert!(set.cli(replica, &["ROLE"]).starts_with("slave\n"));

    assert_eq!(set.cli(primary, &["SET", "key", "value"]).trim(), "OK");
    eventually("the replica to have the key", || {
        set.cli(replica, &["GET", "key"]).trim() == "value"
    });

    let started = Instant::now();
    let killed = set.kill_primary();
    assert_eq!(killed, primary);
    let new = set.wait_for_failover(killed);
    eprintln!("sentinel failed over in {:?}", started.elapsed());
    assert_eq!(new, replica);
    assert_eq!(set.primary_port(), replica);
    assert_eq!(set.cli(new, &["SET", "after", "failover"]).trim(), "OK");
    assert_eq!(set.cli(new, &["GET", "key"]).trim(), "value");

    // The old primary comes back with its data: appendonly is on.
    set.restart(killed);
    assert_eq!(set.cli(killed, &["GET", "key"]).trim(), "value");
}

/// The lowest slot a master owns, from its own `CLUSTER NODES` line.
fn lowest_slot(cluster: &RedisCluster, port: u16) -> u16 {
    let nodes = cluster.cli(port, &["CLUSTER", "NODES"]);
    let me = nodes
        .lines()
        .find(|line| {
            line.split_whitespace()
                .nth(2)
                .unwrap_or("")
                .contains("myself")
        })
        .expect("CLUSTER NODES lists myself");
    let first = me.split_whitespace().nth(8).expect("the master owns slots");
    first.split('-').next().unwrap().parse().unwrap()
}

/// A key hashing to `slot`.
fn key_in_slot(slot: u16) -> String {
    (0..)
        .map(|n| format!("moved:{n}"))
        .find(|key| crc16(key.as_bytes()) % 16384 == slot)
        .unwrap()
}

/// CRC16/XMODEM, the hash Redis Cluster maps keys to slots with.
fn crc16(data: &[u8]) -> u16 {
    let mut crc = 0u16;
    for &byte in data {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// Polls `check` until it holds; panics after 10 s.
fn eventually(what: &str, check: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !check() {
        assert!(Instant::now() < deadline, "waited 10 s for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
