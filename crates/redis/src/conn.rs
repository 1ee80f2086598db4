//! The store's connection: one server (a [`ConnectionManager`]) or a Redis
//! Cluster (a [`ClusterConnection`], which follows `MOVED` and `ASK` and
//! refreshes its slot map when a master fails over), and the walk over
//! every key under a prefix that purging and inspecting share.

use std::collections::HashMap;

use ::redis::aio::{ConnectionLike, ConnectionManager};
use ::redis::cluster_async::ClusterConnection;
use ::redis::cluster_routing::{RoutingInfo, SingleNodeRoutingInfo, Slot};
use ::redis::{Cmd, Pipeline, RedisFuture, Script, Value};
use tokio::task::JoinSet;

use super::SCAN_COUNT;
use tower_idempotency::StoreError;

/// How many per-slot script calls of one `SCAN` page a cluster walk keeps in
/// flight at once.
const CLUSTER_WALK_CONCURRENCY: usize = 32;

/// A connection to one server or to a cluster; cloning shares it.
#[derive(Clone)]
pub(super) enum Conn {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        pipeline: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(pipeline, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(pipeline, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// A `SCAN MATCH` walk over every key under a prefix: on one server, one
/// cursor; on a cluster, one cursor per master, the masters as `CLUSTER
/// SLOTS` names them when the walk starts.
pub(super) struct Walk {
    conn: Conn,
    pattern: String,
    /// The masters still to walk (`None`: the one server), the current last.
    nodes: Vec<Option<Node>>,
    cursor: u64,
}

impl Walk {
    pub(super) async fn new(conn: &Conn, pattern: String) -> Result<Walk, StoreError> {
        let mut conn = conn.clone();
        let nodes = nodes(&mut conn).await?;
        Ok(Walk {
            conn,
            pattern,
            nodes,
            cursor: 0,
        })
    }

    /// The next page of key names; `None` when every node is walked. A page
    /// may be empty, and `SCAN` may return a key twice.
    pub(super) async fn next_page(&mut self) -> Result<Option<Vec<Vec<u8>>>, StoreError> {
        let Some(node) = self.nodes.last().cloned() else {
            return Ok(None);
        };
        let mut scan = ::redis::cmd("SCAN");
        scan.arg(self.cursor)
            .arg("MATCH")
            .arg(&self.pattern)
            .arg("COUNT")
            .arg(SCAN_COUNT);
        let reply = on_node(&mut self.conn, node.as_ref(), scan)
            .await
            .map_err(StoreError::unavailable)?;
        let (next, keys): (u64, Vec<Vec<u8>>) =
            ::redis::from_redis_value(reply).map_err(StoreError::unavailable)?;
        if next == 0 {
            self.nodes.pop();
            self.cursor = 0;
        } else {
            self.cursor = next;
        }
        Ok(Some(keys))
    }

    /// Runs `script` (whose `KEYS` may be many records, `ARGV` `args`) over
    /// `keys`: on one server in batches of [`SCAN_COUNT`]; on a cluster once
    /// per hash slot (a script's keys must share one), several at a time.
    /// The replies, in no particular order.
    pub(super) async fn run(
        &self,
        script: &'static Script,
        keys: Vec<Vec<u8>>,
        args: Vec<Vec<u8>>,
    ) -> Result<Vec<Value>, StoreError> {
        let groups: Vec<Vec<Vec<u8>>> = match &self.conn {
            Conn::Single(_) => keys.chunks(SCAN_COUNT).map(<[_]>::to_vec).collect(),
            Conn::Cluster(_) => {
                let mut by_slot: HashMap<Slot, Vec<Vec<u8>>> = HashMap::new();
                for key in keys {
                    by_slot.entry(Slot::for_key(&key)).or_default().push(key);
                }
                by_slot.into_values().collect()
            }
        };
        let mut replies = Vec::with_capacity(groups.len());
        let mut tasks = JoinSet::new();
        for group in groups {
            if tasks.len() >= CLUSTER_WALK_CONCURRENCY {
                replies.push(joined(tasks.join_next().await)?);
            }
            let mut conn = self.conn.clone();
            let args = args.clone();
            tasks.spawn(async move {
                let mut invocation = script.prepare_invoke();
                invocation.key(group);
                for arg in args {
                    invocation.arg(arg);
                }
                invocation
                    .invoke_async::<Value>(&mut conn)
                    .await
                    .map_err(StoreError::unavailable)
            });
        }
        while let Some(done) = tasks.join_next().await {
            replies.push(joined(Some(done))?);
        }
        Ok(replies)
    }
}

fn joined(
    done: Option<Result<Result<Value, StoreError>, tokio::task::JoinError>>,
) -> Result<Value, StoreError> {
    match done {
        Some(Ok(reply)) => reply,
        Some(Err(e)) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        Some(Err(e)) => Err(StoreError::unavailable(e)),
        None => Err(StoreError::unavailable(
            "a script call of the walk vanished",
        )),
    }
}

/// A cluster node's address: host and port, as `CLUSTER SLOTS` names it.
pub(super) type Node = (String, u16);

/// The nodes to visit one by one: `[None]` for the one server, each master
/// (`Some(address)`) of a cluster.
pub(super) async fn nodes(conn: &mut Conn) -> Result<Vec<Option<Node>>, StoreError> {
    Ok(match conn {
        Conn::Single(_) => vec![None],
        Conn::Cluster(c) => masters(c).await?.into_iter().map(Some).collect(),
    })
}

/// Sends `cmd` to one node of [`nodes`]: on a cluster, the master at
/// `node`; otherwise the one server.
pub(super) async fn on_node(
    conn: &mut Conn,
    node: Option<&Node>,
    cmd: Cmd,
) -> Result<Value, ::redis::RedisError> {
    match (conn, node) {
        (Conn::Cluster(c), Some((host, port))) => {
            let route = RoutingInfo::SingleNode(SingleNodeRoutingInfo::ByAddress {
                host: host.clone(),
                port: *port,
            });
            c.route_command(cmd, route).await
        }
        (conn, _) => cmd.query_async(conn).await,
    }
}

/// The masters' addresses, as `CLUSTER SLOTS` (asked of any node) names
/// them: each slot range's first node.
async fn masters(conn: &mut ClusterConnection) -> Result<Vec<Node>, StoreError> {
    let reply = conn
        .route_command(
            ::redis::cmd("CLUSTER").arg("SLOTS").clone(),
            RoutingInfo::SingleNode(SingleNodeRoutingInfo::Random),
        )
        .await
        .map_err(StoreError::unavailable)?;
    let bad = || StoreError::unavailable("unexpected reply to CLUSTER SLOTS");
    let Value::Array(ranges) = reply else {
        return Err(bad());
    };
    let mut masters = Vec::new();
    for range in ranges {
        let Value::Array(fields) = range else {
            return Err(bad());
        };
        let Some(Value::Array(node)) = fields.get(2) else {
            return Err(bad());
        };
        let host = match node.first() {
            Some(Value::BulkString(b)) => String::from_utf8(b.clone()).map_err(|_| bad())?,
            Some(Value::SimpleString(s)) => s.clone(),
            _ => return Err(bad()),
        };
        let port = match node.get(1) {
            Some(Value::Int(p)) => u16::try_from(*p).map_err(|_| bad())?,
            _ => return Err(bad()),
        };
        if !masters.contains(&(host.clone(), port)) {
            masters.push((host, port));
        }
    }
    Ok(masters)
}
