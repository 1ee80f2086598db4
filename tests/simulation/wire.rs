//! The store host's RPC: one call per TCP connection over the simulated
//! network, each a length-prefixed JSON frame. A call that meets a
//! partition, a crashed peer or a slow answer fails with
//! `StoreError::Unavailable` after [`CALL_TIMEOUT`]: its outcome is unknown,
//! as a real database's is when the connection drops.
//!
//! A [`Session`] keeps one connection for several calls, as a database
//! session does: one-phase mode opens a transaction on it (`Begin`), claims
//! inside it (`ClaimWaiting`) and commits or rolls it back on it. The store
//! host rolls back the transaction of a session whose connection is lost.

use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tower_idempotency::StoreError;

/// The store host's address.
pub const STORE: (&str, u16) = ("store", 7000);
/// How long a server waits for the store's answer.
pub const CALL_TIMEOUT: Duration = Duration::from_millis(400);
/// The largest frame either side accepts.
const MAX_FRAME: u32 = 1 << 20;

/// A record, as the calls name it.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Id {
    pub scope: String,
    pub key: String,
}

/// A credit the handler wrote inside its transaction.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Credit {
    pub account: String,
    pub amount: i64,
}

/// An outbox message the handler enqueued inside its transaction.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Msg {
    pub key: String,
    pub destination: String,
    pub content_type: String,
    pub payload: Vec<u8>,
}

/// A claim's request, as both claims carry it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ClaimArgs {
    pub id: Id,
    pub fingerprint: Vec<u8>,
    pub token: i64,
    pub lease_ms: u64,
    pub ttl_ms: u64,
    pub max_hold_ms: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Call {
    /// A claim that commits at once (two phases: the first).
    Claim(ClaimArgs),
    /// On a session: opens a transaction, ended by the store at
    /// `hold_ms` + 1 s if its session is still idle in it (as
    /// `idle_in_transaction_session_timeout` or MySQL's `wait_timeout`).
    Begin {
        hold_ms: u64,
    },
    /// On a session: the claim, inside the session's transaction if one is
    /// open (uncommitted: other claims of the key wait on it), else
    /// committed at once. A wait on another transaction's claim of the key
    /// lasts at most `wait_ms`, then answers `Busy`.
    ClaimWaiting {
        claim: ClaimArgs,
        wait_ms: u64,
        server: String,
    },
    /// On a session: rolls its transaction back.
    Rollback,
    Complete {
        id: Id,
        token: i64,
        response: Vec<u8>,
    },
    Release {
        id: Id,
        token: i64,
    },
    Renew {
        id: Id,
        token: i64,
        lease_ms: u64,
    },
    Purge,
    /// The transaction's commit: the completion and the handler's writes,
    /// applied together only while the record carries `token`. On a
    /// session it ends the session's transaction too (rolled back if the
    /// completion was refused).
    Commit {
        id: Id,
        token: i64,
        response: Vec<u8>,
        credits: Vec<Credit>,
        messages: Vec<Msg>,
    },
    /// A message written outside any transaction (only a planted bug does).
    Enqueue {
        message: Msg,
    },
    OutboxClaim {
        limit: usize,
        lease_ms: u64,
    },
    OutboxFinish {
        id: i64,
        attempt: u32,
        lease_until_ms: i64,
        fate: WireFate,
    },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum WireFate {
    Done,
    Retry { after_ms: u64 },
    Dead,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum WireClaim {
    Acquired { taken_over: bool },
    Mismatch,
    Completed(Vec<u8>),
    InFlight { remaining_ms: u64 },
}

/// What a claim on a session answers.
#[derive(Debug, Serialize, Deserialize)]
pub enum WireInside {
    Claimed {
        taken_over: bool,
    },
    Refused(WireClaim),
    /// The wait on another open transaction's claim reached its bound.
    Busy,
}

#[derive(Debug, Serialize, Deserialize)]
pub struct WireClaimed {
    pub id: i64,
    pub attempt: u32,
    pub lease_until_ms: i64,
    pub message: Msg,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Reply {
    Claim(WireClaim),
    Inside(WireInside),
    Bool(bool),
    Count(u64),
    Claimed(Vec<WireClaimed>),
    /// The store refused the call (an injected fault): nothing was applied.
    Error(String),
}

fn unavailable(why: impl std::fmt::Display) -> StoreError {
    StoreError::Unavailable(why.to_string().into())
}

/// Sends `call` to the store host and returns its reply.
pub async fn call(call: &Call) -> Result<Reply, StoreError> {
    let exchange = async {
        let mut stream = turmoil::net::TcpStream::connect(STORE).await?;
        write_frame(&mut stream, call).await?;
        read_frame::<Reply>(&mut stream).await
    };
    answered(tokio::time::timeout(CALL_TIMEOUT, exchange).await)
}

fn answered(
    exchange: Result<std::io::Result<Reply>, tokio::time::error::Elapsed>,
) -> Result<Reply, StoreError> {
    match exchange {
        Err(_) => Err(unavailable("the store did not answer in time")),
        Ok(Err(e)) => Err(unavailable(e)),
        Ok(Ok(Reply::Error(e))) => Err(unavailable(e)),
        Ok(Ok(reply)) => Ok(reply),
    }
}

/// One connection to the store host kept for several calls. After a call
/// failed it must be dropped (a reply may still be on its way), which
/// closes the connection: the store rolls back its open transaction.
pub struct Session {
    stream: turmoil::net::TcpStream,
}

impl Session {
    pub async fn open() -> Result<Session, StoreError> {
        let connect = turmoil::net::TcpStream::connect(STORE);
        match tokio::time::timeout(CALL_TIMEOUT, connect).await {
            Err(_) => Err(unavailable("the store did not answer in time")),
            Ok(Err(e)) => Err(unavailable(e)),
            Ok(Ok(stream)) => Ok(Session { stream }),
        }
    }

    /// `call` on this session, answered within `within`.
    pub async fn call(&mut self, call: &Call, within: Duration) -> Result<Reply, StoreError> {
        let stream = &mut self.stream;
        let exchange = async {
            write_frame(stream, call).await?;
            read_frame::<Reply>(stream).await
        };
        answered(tokio::time::timeout(within, exchange).await)
    }
}

pub async fn write_frame<T: Serialize>(
    stream: &mut turmoil::net::TcpStream,
    value: &T,
) -> std::io::Result<()> {
    let bytes = serde_json::to_vec(value)?;
    let len = u32::try_from(bytes.len()).map_err(std::io::Error::other)?;
    stream.write_all(&len.to_be_bytes()).await?;
    stream.write_all(&bytes).await?;
    stream.flush().await
}

pub async fn read_frame<T: for<'de> Deserialize<'de>>(
    stream: &mut turmoil::net::TcpStream,
) -> std::io::Result<T> {
    let len = stream.read_u32().await?;
    if len > MAX_FRAME {
        return Err(std::io::Error::other("frame too large"));
    }
    let mut bytes = vec![0; len as usize];
    stream.read_exact(&mut bytes).await?;
    Ok(serde_json::from_slice(&bytes)?)
}
