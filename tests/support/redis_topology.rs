//! Real Redis topologies of the test's own: a Redis Cluster, and a primary with a replica
//! watched by three Sentinels. For tests of cluster and Sentinel support that kill
//! masters, wait for failovers, move slots and count commands per node.
//!
//! The code is synchronous and blocks for a few seconds while a topology forms or fails
//! over; async tests call it through `tokio::task::spawn_blocking`.

use std::{
    collections::HashMap,
    fs,
    net::{TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// How long a topology may take to form, or to settle after a change.
const SETTLE_LIMIT: Duration = Duration::from_secs(20);

/// How long Sentinel may take to fail over: detection, agreement, leader election, and
/// one more election round should the first split its votes.
const SENTINEL_FAILOVER_LIMIT: Duration = Duration::from_secs(30);

/// The number of hash slots in a Redis Cluster.
const CLUSTER_SLOTS: usize = 16384;

/// The name the Sentinels monitor the primary under.
const MASTER_NAME: &str = "idem";

// ---------------------------------------------------------------------------------------
// A Redis Cluster.

/// A throwaway Redis Cluster on free loopback ports; every node is killed and the data
/// directory removed when dropped.
pub struct RedisCluster {
    dir: PathBuf,
    nodes: Vec<Process>,
    /// The replicas each killed master had when it was killed, for `wait_for_failover`.
    orphans: HashMap<u16, Vec<u16>>,
}

impl RedisCluster {
    /// Starts `masters` masters (at least 3, as `redis-cli --cluster create` requires),
    /// each with `replicas_per_master` replicas, without persistence, and waits until the
    /// cluster is formed.
    pub fn start(masters: usize, replicas_per_master: usize) -> Self {
        Self::start_with(masters, replicas_per_master, false)
    }

    /// Like [`RedisCluster::start`]; `persistent` turns on `appendonly yes`, so a node
    /// brought back with [`RedisCluster::restart`] keeps its data.
    ///
    /// Returns once every node reports `cluster_state:ok` with all 16384 slots assigned,
    /// knows every other node, agrees with the others on who owns which slots, and every
    /// replica's link to its master is up. Panics if that takes longer than 20 s.
    pub fn start_with(masters: usize, replicas_per_master: usize, persistent: bool) -> Self {
        on_free_ports(|| Self::start_on_free_ports(masters, replicas_per_master, persistent))
    }

    fn start_on_free_ports(masters: usize, replicas_per_master: usize, persistent: bool) -> Self {
        assert!(
            masters >= 3,
            "redis-cli --cluster create needs at least 3 masters"
        );
        let count = masters * (1 + replicas_per_master);
        // Each node needs a client port and a cluster bus port. The bus port is given
        // explicitly: the default, port + 10000, overflows for high ephemeral ports.
        let ports = free_ports(2 * count);
        let (ports, bus_ports) = ports.split_at(count);
        let dir = temp_dir("cluster");
        let nodes = ports
            .iter()
            .zip(bus_ports)
            .map(|(&port, &bus_port)| {
                let mut args = data_node_args(port, &dir, persistent);
                args.extend(
                    [
                        "--cluster-enabled",
                        "yes",
                        "--cluster-port",
                        &bus_port.to_string(),
                        "--cluster-config-file",
                        &format!("nodes-{port}.conf"),
                        "--cluster-node-timeout",
                        "1000",
                        // Any replica may take over, however long its link was down.
                        "--cluster-replica-validity-factor",
                        "0",
                        // A cluster missing slots answers errors, not stale reads.
                        "--cluster-allow-reads-when-down",
                        "no",
                    ]
                    .map(String::from),
                );
                Process::spawn(port, args)
            })
            .collect::<Vec<_>>();
        let mut cluster = Self {
            dir,
            nodes,
            orphans: HashMap::new(),
        };
        for node in &mut cluster.nodes {
            node.wait_up();
        }

        let addresses = ports.iter().map(|port| format!("127.0.0.1:{port}"));
        let output = Command::new("redis-cli")
            .arg("--cluster")
            .arg("create")
            .args(addresses)
            .args(["--cluster-replicas", &replicas_per_master.to_string()])
            .arg("--cluster-yes")
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli on PATH");
        assert!(
            output.status.success(),
            "redis-cli --cluster create failed:\n{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );

        cluster.wait_settled("the new cluster to form", |port| {
            let info = cli(port, &["CLUSTER", "INFO"]);
            if number(&info, "cluster_slots_assigned") != Some(CLUSTER_SLOTS) {
                return Err(format!("port {port}: slots unassigned:\n{info}"));
            }
            if number(&info, "cluster_known_nodes") != Some(count) {
                return Err(format!("port {port}: not every node known:\n{info}"));
            }
            if role(port) == "slave" {
                let replication = cli(port, &["INFO", "replication"]);
                if field(&replication, "master_link_status") != Some("up") {
                    return Err(format!("port {port}: replica link down:\n{replication}"));
                }
            }
            Ok(())
        });
        // Guards against a create that silently made other roles than asked for.
        let replicas = cluster.replica_ports().len();
        assert_eq!(
            replicas,
            masters * replicas_per_master,
            "replicas after create"
        );
        cluster
    }

    /// `redis://127.0.0.1:<port>/` of every node, killed ones included.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(|node| url(node.port)).collect()
    }

    /// The live nodes that are masters now (asked of each with `ROLE`).
    pub fn master_ports(&self) -> Vec<u16> {
        self.live_ports()
            .filter(|&port| role(port) == "master")
            .collect()
    }

    /// The live nodes that are replicas now (asked of each with `ROLE`).
    pub fn replica_ports(&self) -> Vec<u16> {
        self.live_ports()
            .filter(|&port| role(port) == "slave")
            .collect()
    }

    /// Runs a command with `redis-cli` (not in cluster mode: no redirects are followed)
    /// against one node and returns its output; errors such as `MOVED` are in it too.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, args)
    }

    /// Kills a node (SIGKILL: a crash, not a shutdown) and waits until its port is closed.
    /// A master's replicas are noted first, for [`RedisCluster::wait_for_failover`].
    pub fn kill(&mut self, port: u16) {
        if role(port) == "master" {
            let nodes = parse_nodes(&cli(port, &["CLUSTER", "NODES"]));
            let me = nodes
                .iter()
                .find(|node| node.has_flag("myself"))
                .expect("CLUSTER NODES lists myself");
            let replicas = nodes
                .iter()
                .filter(|node| node.has_flag("slave") && node.master == me.id)
                .map(|node| node.port)
                .collect();
            self.orphans.insert(port, replicas);
        }
        self.node(port).kill();
    }

    /// Starts a killed node again on the same ports and directory (so with its cluster
    /// identity, and with its data if persistent), then waits until the cluster has
    /// settled: a master that was failed over meanwhile comes back as a replica.
    pub fn restart(&mut self, port: u16) {
        let node = self.node(port);
        node.start();
        node.wait_up();
        self.wait_settled("the cluster to settle after a restart", |_| Ok(()));
    }

    /// Waits until every replica of `master` has acknowledged all its writes, so killing
    /// it loses nothing: `ROLE` lists the master's offset, then each replica's host, port
    /// and offset. Panics after 20 s.
    pub fn wait_replicated(&self, master: u16) {
        wait_for(SETTLE_LIMIT, "the replicas to catch up", || {
            let role = cli(master, &["ROLE"]);
            let lines: Vec<&str> = role.lines().collect();
            let caught_up = lines.len() >= 5
                && lines[4..]
                    .iter()
                    .step_by(3)
                    .all(|offset| *offset == lines[1]);
            caught_up.then_some(()).ok_or(role)
        })
    }

    /// The port of the master serving `key`'s slot, as a live node sees the cluster.
    pub fn master_for_key(&self, key: &str) -> u16 {
        let port = self.any_live_port();
        let slot: usize = cli(port, &["CLUSTER", "KEYSLOT", key])
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("CLUSTER KEYSLOT {key} on port {port}"));
        parse_nodes(&cli(port, &["CLUSTER", "NODES"]))
            .into_iter()
            .find(|node| node.is_serving_master() && node.owns(slot))
            .unwrap_or_else(|| panic!("no master owns slot {slot} (of {key:?})"))
            .port
    }

    /// Waits until one of the killed master's replicas has taken over and every live node
    /// reports `cluster_state:ok` and the same slot owners; returns the new master's port.
    /// Panics after 20 s, or if `killed_port` was not a master killed with
    /// [`RedisCluster::kill`].
    pub fn wait_for_failover(&self, killed_port: u16) -> u16 {
        let replicas = self
            .orphans
            .get(&killed_port)
            .unwrap_or_else(|| panic!("port {killed_port} is not a master killed with kill()"));
        assert!(
            !replicas.is_empty(),
            "the master on port {killed_port} had no replica to fail over to"
        );
        let promoted = wait_for(
            SETTLE_LIMIT,
            &format!("a replica of port {killed_port} to take over"),
            || {
                replicas
                    .iter()
                    .copied()
                    .find(|&port| self.is_live(port) && role(port) == "master")
                    .ok_or_else(|| format!("no replica is master yet: {replicas:?}"))
            },
        );
        self.wait_settled("the cluster to settle after a failover", |_| Ok(()));
        promoted
    }

    /// Moves `slots` hash slots (the lowest-numbered ones) and their keys from one master
    /// to another with `redis-cli --cluster reshard`, and waits until every live node
    /// agrees on the new owners.
    pub fn reshard(&self, from_port: u16, to_port: u16, slots: usize) {
        let from = cli(from_port, &["CLUSTER", "MYID"]).trim().to_owned();
        let to = cli(to_port, &["CLUSTER", "MYID"]).trim().to_owned();
        let output = Command::new("redis-cli")
            .args(["--cluster", "reshard", &format!("127.0.0.1:{from_port}")])
            .args(["--cluster-from", &from, "--cluster-to", &to])
            .args(["--cluster-slots", &slots.to_string(), "--cluster-yes"])
            .stdin(Stdio::null())
            .output()
            .expect("redis-cli on PATH");
        let stdout = String::from_utf8_lossy(&output.stdout);
        // redis-cli reports some failures (a cluster it will not touch) on stdout only.
        assert!(
            output.status.success() && !stdout.contains("[ERR]"),
            "redis-cli --cluster reshard failed:\n{stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        self.wait_settled("the cluster to settle after resharding", |_| Ok(()));
    }

    /// The number of keys on one node (`DBSIZE`).
    pub fn keys_on(&self, port: u16) -> u64 {
        let reply = cli(port, &["DBSIZE"]);
        reply
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("DBSIZE on port {port}: {reply:?}"))
    }

    /// `INFO commandstats` of one node: `cmdstat_<command>:calls=N,...` lines.
    pub fn commandstats(&self, port: u16) -> String {
        cli(port, &["INFO", "commandstats"])
    }

    fn node(&mut self, port: u16) -> &mut Process {
        self.nodes
            .iter_mut()
            .find(|node| node.port == port)
            .unwrap_or_else(|| panic!("port {port} is no node of this cluster"))
    }

    fn is_live(&self, port: u16) -> bool {
        self.nodes
            .iter()
            .any(|node| node.port == port && node.is_live())
    }

    fn live_ports(&self) -> impl Iterator<Item = u16> + '_ {
        self.nodes
            .iter()
            .filter(|node| node.is_live())
            .map(|node| node.port)
    }

    fn any_live_port(&self) -> u16 {
        self.live_ports().next().expect("a live node")
    }

    /// Waits until every live node reports `cluster_state:ok`, all live nodes see the same
    /// masters owning the same slots (so a client gets one answer whichever it asks), and
    /// `extra` holds for each.
    fn wait_settled(&self, what: &str, extra: impl Fn(u16) -> Result<(), String>) {
        wait_for(SETTLE_LIMIT, what, || {
            let mut first: Option<(u16, SlotOwners)> = None;
            for port in self.live_ports() {
                let info = cli(port, &["CLUSTER", "INFO"]);
                if field(&info, "cluster_state") != Some("ok") {
                    return Err(format!("port {port}: not ok:\n{info}"));
                }
                let owners = slot_owners(port);
                match &first {
                    None => first = Some((port, owners)),
                    Some((first_port, first_owners)) if *first_owners != owners => {
                        return Err(format!(
                            "ports {first_port} and {port} disagree on slot owners:\n\
                             {first_owners:?}\n{owners:?}"
                        ));
                    }
                    Some(_) => {}
                }
                extra(port)?;
            }
            Ok(())
        })
    }
}

impl Drop for RedisCluster {
    fn drop(&mut self) {
        // Processes first: a live server could write into the directory being removed.
        for node in &mut self.nodes {
            node.kill_quietly();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// One line of `CLUSTER NODES`.
struct ClusterNode {
    id: String,
    port: u16,
    flags: Vec<String>,
    /// The master's id for a replica, `-` for a master.
    master: String,
    /// `N` and `N-M` entries; migration markers (`[N->-id]`) are left out.
    slots: Vec<String>,
}

impl ClusterNode {
    fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f == flag)
    }

    /// A master that is not considered failed.
    fn is_serving_master(&self) -> bool {
        self.has_flag("master") && !self.has_flag("fail")
    }

    fn owns(&self, slot: usize) -> bool {
        self.slots.iter().any(|range| {
            let (start, end) = range.split_once('-').unwrap_or((range, range));
            let (start, end) = (start.parse(), end.parse());
            matches!((start, end), (Ok(start), Ok(end)) if (start..=end).contains(&slot))
        })
    }
}

/// Parses `CLUSTER NODES`: `id ip:port@bus[,hostname] flags master ping pong epoch link
/// slots...`.
fn parse_nodes(text: &str) -> Vec<ClusterNode> {
    text.lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            if fields.len() < 8 {
                return None;
            }
            let address = fields[1].split('@').next()?;
            let port = address.rsplit(':').next()?.parse().ok()?;
            Some(ClusterNode {
                id: fields[0].to_owned(),
                port,
                flags: fields[2].split(',').map(String::from).collect(),
                master: fields[3].to_owned(),
                slots: fields[8..]
                    .iter()
                    .filter(|slot| !slot.starts_with('['))
                    .map(|slot| slot.to_string())
                    .collect(),
            })
        })
        .collect()
}

/// Master ids with the slot ranges each owns, sorted, so two nodes' views compare.
type SlotOwners = Vec<(String, Vec<String>)>;

/// Which master owns which slots, as one node sees it.
fn slot_owners(port: u16) -> SlotOwners {
    let mut owners: Vec<_> = parse_nodes(&cli(port, &["CLUSTER", "NODES"]))
        .into_iter()
        .filter(|node| node.has_flag("master") && !node.slots.is_empty())
        .map(|node| (node.id, node.slots))
        .collect();
    owners.sort();
    owners
}

// ---------------------------------------------------------------------------------------
// A primary and a replica watched by Sentinel.

/// A throwaway primary and replica watched by three Sentinels (quorum 2) on free loopback
/// ports; every process is killed and the directory removed when dropped.
pub struct SentinelSet {
    dir: PathBuf,
    /// The initial primary, then the initial replica.
    data: Vec<Process>,
    sentinels: Vec<Process>,
}

impl SentinelSet {
    /// Starts the set without persistence and waits until a failover could happen.
    pub fn start() -> Self {
        Self::start_with(false)
    }

    /// Like [`SentinelSet::start`]; `persistent` turns on `appendonly yes` on the data
    /// servers, so one brought back with [`SentinelSet::restart`] keeps its data.
    ///
    /// Returns once the replica's link is up and every Sentinel knows the replica and the
    /// two other Sentinels. Panics if that takes longer than 20 s.
    pub fn start_with(persistent: bool) -> Self {
        on_free_ports(|| Self::start_on_free_ports(persistent))
    }

    fn start_on_free_ports(persistent: bool) -> Self {
        let ports = free_ports(5);
        let (primary_port, replica_port) = (ports[0], ports[1]);
        let dir = temp_dir("sentinel");
        let primary = Process::spawn(primary_port, data_node_args(primary_port, &dir, persistent));
        let mut replica_args = data_node_args(replica_port, &dir, persistent);
        replica_args
            .extend(["--replicaof", "127.0.0.1", &primary_port.to_string()].map(String::from));
        let replica = Process::spawn(replica_port, replica_args);
        let mut set = Self {
            dir,
            data: vec![primary, replica],
            sentinels: Vec::new(),
        };
        for server in &mut set.data {
            server.wait_up();
        }
        // Sentinels learn of replicas from the primary's INFO, which they ask for at once
        // and then only every 10 s: start them once the replica is attached.
        wait_for(SETTLE_LIMIT, "the replica to sync", || {
            let replication = cli(replica_port, &["INFO", "replication"]);
            let primary = cli(primary_port, &["INFO", "replication"]);
            if field(&replication, "master_link_status") != Some("up") {
                Err(format!("replica link down:\n{replication}"))
            } else if field(&primary, "connected_slaves") != Some("1") {
                Err(format!("primary sees no replica:\n{primary}"))
            } else {
                Ok(())
            }
        });

        for &port in &ports[2..] {
            let config = set.dir.join(format!("sentinel-{port}.conf"));
            // Sentinel rewrites its config file, so each gets a writable one of its own.
            let text = format!(
                "port {port}\n\
                 bind 127.0.0.1\n\
                 protected-mode no\n\
                 dir {dir}\n\
                 sentinel monitor {MASTER_NAME} 127.0.0.1 {primary_port} 2\n\
                 sentinel down-after-milliseconds {MASTER_NAME} 1000\n\
                 sentinel failover-timeout {MASTER_NAME} 3000\n\
                 sentinel parallel-syncs {MASTER_NAME} 1\n",
                dir = set.dir.display(),
            );
            fs::write(&config, text).expect("write sentinel config");
            let args = vec![config.display().to_string(), "--sentinel".to_owned()];
            set.sentinels.push(Process::spawn(port, args));
        }
        for sentinel in &mut set.sentinels {
            sentinel.wait_up();
        }
        // Equivalent to SENTINEL REPLICAS being non-empty and SENTINEL SENTINELS listing
        // two, in one line: `master0:name=idem,status=ok,address=...,slaves=1,sentinels=3`.
        wait_for(SETTLE_LIMIT, "the Sentinels to find each other", || {
            for sentinel in &set.sentinels {
                let info = cli(sentinel.port, &["INFO", "sentinel"]);
                let master = field(&info, "master0").unwrap_or_default();
                if !(master.contains("status=ok")
                    && master.contains(",slaves=1,")
                    && master.ends_with(",sentinels=3"))
                {
                    return Err(format!("sentinel {}: {master}", sentinel.port));
                }
            }
            Ok(())
        });
        set
    }

    /// `redis://127.0.0.1:<port>/` of every Sentinel.
    pub fn sentinel_urls(&self) -> Vec<String> {
        self.sentinels.iter().map(|s| url(s.port)).collect()
    }

    /// The name the Sentinels monitor the primary under.
    pub fn master_name(&self) -> &str {
        MASTER_NAME
    }

    /// The current primary's port, as a live Sentinel names it.
    pub fn primary_port(&self) -> u16 {
        let sentinel = self
            .sentinels
            .iter()
            .find(|s| s.is_live())
            .expect("a live sentinel");
        master_addr(sentinel.port)
            .unwrap_or_else(|| panic!("sentinel {} names no primary", sentinel.port))
    }

    /// The ports of both data servers, whatever their roles now: the initial primary
    /// first.
    pub fn data_ports(&self) -> Vec<u16> {
        self.data.iter().map(|server| server.port).collect()
    }

    /// Kills the current primary (SIGKILL) and waits until its port is closed; returns
    /// its port.
    pub fn kill_primary(&mut self) -> u16 {
        let port = self.primary_port();
        self.data_server(port).kill();
        port
    }

    /// Starts a killed data server again on the same port and directory (with its data if
    /// persistent) and waits until it answers. A former primary comes back as a primary
    /// until the Sentinels turn it into a replica of the new one, some seconds later.
    pub fn restart(&mut self, port: u16) {
        let server = self.data_server(port);
        server.start();
        server.wait_up();
    }

    /// Waits until every live Sentinel names the same primary other than `old_port` and
    /// that server's `ROLE` says master; returns its port. Panics after 30 s.
    pub fn wait_for_failover(&self, old_port: u16) -> u16 {
        wait_for(
            SENTINEL_FAILOVER_LIMIT,
            &format!("Sentinel to fail over from port {old_port}"),
            || {
                let named: Vec<Option<u16>> = self
                    .sentinels
                    .iter()
                    .filter(|s| s.is_live())
                    .map(|s| master_addr(s.port))
                    .collect();
                match named[..] {
                    [Some(port), ..]
                        if port != old_port
                            && named.iter().all(|&p| p == Some(port))
                            && role(port) == "master" =>
                    {
                        Ok(port)
                    }
                    _ => Err(format!("sentinels name {named:?}")),
                }
            },
        )
    }

    /// Runs a command with `redis-cli` against a data server or a Sentinel and returns
    /// its output; error replies are in it too.
    pub fn cli(&self, port: u16, args: &[&str]) -> String {
        cli(port, args)
    }

    fn data_server(&mut self, port: u16) -> &mut Process {
        self.data
            .iter_mut()
            .find(|server| server.port == port)
            .unwrap_or_else(|| panic!("port {port} is no data server of this set"))
    }
}

impl Drop for SentinelSet {
    fn drop(&mut self) {
        // Sentinels first, so none reconfigures a server while the others go down.
        for process in self.sentinels.iter_mut().chain(&mut self.data) {
            process.kill_quietly();
        }
        let _ = fs::remove_dir_all(&self.dir);
    }
}

/// The primary's port a Sentinel names (`SENTINEL GET-MASTER-ADDR-BY-NAME`), if any.
fn master_addr(sentinel_port: u16) -> Option<u16> {
    let reply = cli(
        sentinel_port,
        &["SENTINEL", "GET-MASTER-ADDR-BY-NAME", MASTER_NAME],
    );
    reply.lines().nth(1)?.trim().parse().ok()
}

// ---------------------------------------------------------------------------------------
// Processes and redis-cli.

/// One server process, with the arguments to start it again on the same port.
struct Process {
    port: u16,
    args: Vec<String>,
    child: Option<Child>,
}

impl Process {
    /// Spawns `redis-server` with `args`; [`Process::wait_up`] waits until it answers.
    fn spawn(port: u16, args: Vec<String>) -> Self {
        let mut process = Self {
            port,
            args,
            child: None,
        };
        process.start();
        process
    }

    fn start(&mut self) {
        assert!(self.child.is_none(), "port {} is still running", self.port);
        let child = Command::new("redis-server")
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("redis-server on PATH (the test script installs it)");
        self.child = Some(child);
    }

    fn is_live(&self) -> bool {
        self.child.is_some()
    }

    /// Waits until it answers PING; panics if it exits first (say, its port was taken
    /// meanwhile) or takes longer than 10 s.
    fn wait_up(&mut self) {
        let port = self.port;
        let child = self.child.as_mut().expect("started");
        wait_for(
            Duration::from_secs(10),
            &format!("redis-server on port {port} to come up"),
            || {
                if let Ok(Some(status)) = child.try_wait() {
                    panic!("redis-server on port {port} exited at start ({status}): {PORT_TAKEN}");
                }
                let reply = cli(port, &["PING"]);
                (reply.trim() == "PONG").then_some(()).ok_or(reply)
            },
        );
    }

    /// SIGKILL (a crash, not a shutdown), then waits until the port is closed.
    fn kill(&mut self) {
        assert!(self.child.is_some(), "port {} is not running", self.port);
        self.kill_quietly();
        let port = self.port;
        wait_for(
            Duration::from_secs(10),
            &format!("port {port} to close"),
            || match TcpStream::connect(("127.0.0.1", port)) {
                Ok(_) => Err("still accepting".to_owned()),
                Err(_) => Ok(()),
            },
        );
    }

    fn kill_quietly(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        self.kill_quietly();
    }
}

/// The arguments every data server gets: loopback only, a directory of its own (servers
/// sharing one would overwrite each other's RDB and AOF files), and no snapshots.
fn data_node_args(port: u16, dir: &Path, persistent: bool) -> Vec<String> {
    let dir = dir.join(port.to_string());
    fs::create_dir_all(&dir).expect("create node dir");
    [
        "--port",
        &port.to_string(),
        "--bind",
        "127.0.0.1",
        "--dir",
        &dir.display().to_string(),
        "--save",
        "",
        "--appendonly",
        if persistent { "yes" } else { "no" },
        "--protected-mode",
        "no",
        // A master otherwise waits 5 s for more replicas before a full sync.
        "--repl-diskless-sync-delay",
        "0",
    ]
    .map(String::from)
    .to_vec()
}

/// Runs `start` again, on new ports, when a server it started found its port taken: a port
/// is free when chosen and bound by the server a moment later, and in between another
/// process's outgoing connection may take it. Whatever the failed attempt started is
/// stopped as it unwinds.
fn on_free_ports<T>(start: impl Fn() -> T + std::panic::RefUnwindSafe) -> T {
    const ATTEMPTS: usize = 3;
    for attempt in 1.. {
        match std::panic::catch_unwind(&start) {
            Ok(started) => return started,
            Err(panic) => {
                let message = panic
                    .downcast_ref::<String>()
                    .map(String::as_str)
                    .unwrap_or_default();
                if attempt == ATTEMPTS || !message.contains(PORT_TAKEN) {
                    std::panic::resume_unwind(panic);
                }
            }
        }
    }
    unreachable!()
}

/// What [`Process::wait_up`]'s panic says when the server exited at start.
const PORT_TAKEN: &str = "port taken?";

/// `n` distinct free loopback ports: every listener is held until all are bound, so none
/// is handed out twice.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("free port"))
        .collect();
    listeners
        .iter()
        .map(|l| l.local_addr().expect("bound address").port())
        .collect()
}

/// A new directory under the system's temp dir, with a random name.
fn temp_dir(kind: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "tower-idempotency-{kind}-{:016x}",
        rand::random::<u64>()
    ));
    fs::create_dir_all(&dir).expect("create temp dir");
    dir
}

/// `redis://127.0.0.1:<port>/`.
fn url(port: u16) -> String {
    format!("redis://127.0.0.1:{port}/")
}

/// Runs `redis-cli` against a port and returns its output. Not on a terminal, it prints
/// replies raw (one value a line) and error replies to stdout; an unreachable server
/// gives an empty string.
fn cli(port: u16, args: &[&str]) -> String {
    let output = Command::new("redis-cli")
        .args(["-h", "127.0.0.1", "-p", &port.to_string()])
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("redis-cli on PATH");
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// The first line of `ROLE`: `master`, `slave` or `sentinel` (empty if unreachable).
fn role(port: u16) -> String {
    cli(port, &["ROLE"])
        .lines()
        .next()
        .unwrap_or_default()
        .trim()
        .to_owned()
}

/// A `name:value` field of `INFO` or `CLUSTER INFO` output.
fn field<'a>(info: &'a str, name: &str) -> Option<&'a str> {
    info.lines()
        .find_map(|line| line.trim_end().strip_prefix(name)?.strip_prefix(':'))
}

/// A numeric `name:value` field of `INFO` or `CLUSTER INFO` output.
fn number(info: &str, name: &str) -> Option<usize> {
    field(info, name)?.parse().ok()
}

/// Polls `check` every 50 ms until it succeeds, panicking with `what` and the last
/// failure once `limit` has passed.
fn wait_for<T>(limit: Duration, what: &str, mut check: impl FnMut() -> Result<T, String>) -> T {
    let deadline = Instant::now() + limit;
    loop {
        match check() {
            Ok(value) => return value,
            Err(last) if Instant::now() >= deadline => {
                panic!("waited {limit:?} for {what}; last seen: {last}")
            }
            Err(_) => std::thread::sleep(Duration::from_millis(50)),
        }
    }
}
