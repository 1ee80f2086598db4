//! A model of tower-idempotency's protocol, checked exhaustively with
//! stateright: requests and their retries, servers that claim, renew,
//! complete, release and crash, one store with leases, fencing tokens, a TTL
//! and a clock that can step back once, the modes (transactional in two
//! phases or in one, with its row locks and bounded waits), and the
//! outbox's enqueue, relay lease, send and ack against a downstream that
//! fails, hangs and answers late.
//!
//! It models the protocol, not the crate's code: each rule below names the
//! file of the crate it mirrors. `proof/README.md` says what is left out.
//!
//! Time is discrete: one `Tick` moves the store's clock and every process's
//! own (monotonic) clock by one. The store's clock may also step back once,
//! by [`Bounds::step`].

use std::fmt;

use stateright::{Model, Property};

/// When the record of a request is written (`src/mode.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mode {
    /// The claim commits at once; the handler commits its effect (and its
    /// outbox message) in its own transaction; the record is completed in a
    /// second write.
    Separate,
    /// Two phases (PostgreSQL, MySQL): the claim commits first, so other
    /// servers see it; the effect, its outbox message and the completed
    /// record commit together, fenced by the token, or not at all.
    Transactional,
    /// One phase (PostgreSQL's default, `src/store/kit/one_phase.rs`): the
    /// claim is written inside the handler's transaction and commits with
    /// the effect, its outbox message and the completion, or vanishes with
    /// them. Another claim of the key meets the uncommitted claim only as a
    /// row lock, and waits on it at most its bound. The first
    /// [`Bounds::commit_first`] requests go to servers whose claims commit
    /// first (two phases), as in a fleet being changed over.
    TransactionalOnePhase,
}

/// One planted bug at a time (issue 24, item 3; issue 37, one phase), or
/// none.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Mutation {
    /// The model as the crate is.
    None,
    /// `complete` (and the transactional commit) writes whatever token the
    /// record carries.
    CompleteIgnoresToken,
    /// A lease is alive while its deadline is ahead, however far: a clock
    /// stepped back is trusted.
    LeaseTrustsSteppedClock,
    /// `release` deletes the in-flight record whatever token it carries.
    ReleaseWithoutToken,
    /// The relay marks a message delivered before the downstream answered.
    AckBeforeSend,
    /// The outbox message is written in a transaction of its own, after the
    /// effect's commit.
    EnqueueOutsideTransaction,
    /// A claim takes an in-flight record over while its lease is alive.
    TakeoverWhileLeaseAlive,
    /// A claim in one phase commits before the work (as phase one would),
    /// while its holder still counts on a rollback to free the key: no
    /// renewal, no release.
    OnePhaseClaimCommittedBeforeWork,
    /// A claim's wait on another's open claim has no bound (as a lock
    /// timeout set where it does not hold, e.g. `SET LOCAL` before `BEGIN`):
    /// it waits as long as the holder holds, up to its max hold.
    WaitIgnoresBound,
}

impl Mutation {
    /// Every planted bug, with the name `PROOF_MUTATION` takes.
    pub const ALL: [(&'static str, Mutation); 8] = [
        ("complete-ignores-token", Mutation::CompleteIgnoresToken),
        (
            "lease-trusts-stepped-clock",
            Mutation::LeaseTrustsSteppedClock,
        ),
        ("release-without-token", Mutation::ReleaseWithoutToken),
        ("ack-before-send", Mutation::AckBeforeSend),
        (
            "enqueue-outside-transaction",
            Mutation::EnqueueOutsideTransaction,
        ),
        (
            "takeover-while-lease-alive",
            Mutation::TakeoverWhileLeaseAlive,
        ),
        (
            "one-phase-claim-committed-before-work",
            Mutation::OnePhaseClaimCommittedBeforeWork,
        ),
        ("wait-ignores-bound", Mutation::WaitIgnoresBound),
    ];

    /// Whether the bug is planted in `mode`: the two of one phase change
    /// nothing elsewhere, where the model would be checked unmutated.
    pub fn planted_in(self, mode: Mode) -> bool {
        match self {
            Mutation::OnePhaseClaimCommittedBeforeWork | Mutation::WaitIgnoresBound => {
                mode == Mode::TransactionalOnePhase
            }
            _ => true,
        }
    }

    /// The mutation named `name` (`none` or one of [`Mutation::ALL`]).
    pub fn parse(name: &str) -> Option<Mutation> {
        if name.is_empty() || name == "none" {
            return Some(Mutation::None);
        }
        Self::ALL.iter().find(|(n, _)| *n == name).map(|(_, m)| *m)
    }
}

/// The bounds of one check. Every number is small on purpose: the state
/// space grows with each.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Bounds {
    /// App servers (each runs one request at a time).
    pub servers: u8,
    /// Requests (logical operations), spread over the keys round-robin:
    /// with 3 requests and 2 keys, requests 0 and 2 share key 0 (a
    /// concurrent duplicate, as a double click sends).
    pub requests: u8,
    /// Keys.
    pub keys: u8,
    /// Attempts per request: the first and its retries.
    pub attempts: u8,
    /// Crashes, of servers and relays together.
    pub crashes: u8,
    /// The idempotency lease, in ticks.
    pub lease: u8,
    /// The record's TTL, in ticks.
    pub ttl: u8,
    /// The longest a holder renews its lease, from its claim
    /// (`max_hold(max_hold)`); with the lease, within the TTL.
    pub max_hold: u8,
    /// How far the store's clock steps back, once (0: never).
    pub step: u8,
    /// The last tick.
    pub ticks: u8,
    /// Relays.
    pub relays: u8,
    /// The relay's lease on a message, in ticks.
    pub relay_lease: u8,
    /// How long a relay waits for the downstream's answer (below the relay
    /// lease, as `Config::attempt_timeout` keeps it).
    pub answer_timeout: u8,
    /// Attempts per message before it becomes a dead letter.
    pub max_attempts: u8,
    /// One phase: how long a claim waits on another's open claim of its key
    /// before it is refused in flight (`wait_in_flight`; 0 is the least, 1
    /// ms: the wait ends before time moves on).
    pub wait: u8,
    /// One phase: the first `commit_first` requests go to servers whose
    /// claims commit first (`commit_claims_first(true)`), so claims in one
    /// phase meet committed in-flight records too.
    pub commit_first: u8,
}

impl Bounds {
    /// What CI checks of the idempotency protocol: 2 servers, 2 keys, 3
    /// requests with a retry each, a crash, one clock step, no relay.
    pub const CI: Bounds = Bounds {
        servers: 2,
        requests: 3,
        keys: 2,
        attempts: 2,
        crashes: 1,
        lease: 2,
        ttl: 5,
        max_hold: 3,
        step: 2,
        ticks: 4,
        relays: 0,
        relay_lease: 2,
        answer_timeout: 1,
        max_attempts: 2,
        wait: 1,
        commit_first: 0,
    };

    /// What CI checks of the outbox: the same model with 2 relays, and one
    /// server whose request (with a retry) commits the effects they deliver.
    /// The relays meet the rest of the protocol only through committed
    /// rows, so the two checks together cover the model within their
    /// bounds (`proof/README.md`).
    pub const CI_OUTBOX: Bounds = Bounds {
        servers: 1,
        requests: 1,
        relays: 2,
        ..Bounds::CI
    };

    /// What CI checks of the protocol in one phase: one key, three
    /// requests on it (the first commits its claim first) on three servers,
    /// so a claim in one phase can hold the key while another waits on it
    /// and a committed claim it took over waits for its end; a tick more,
    /// for the max hold.
    pub const CI_ONE_PHASE: Bounds = Bounds {
        servers: 3,
        keys: 1,
        ticks: 5,
        commit_first: 1,
        ..Bounds::CI
    };

    /// `PROOF_BOUND=large`, one phase: more time, and a second crash.
    pub const LARGE_ONE_PHASE: Bounds = Bounds {
        ticks: 6,
        crashes: 2,
        ..Bounds::CI_ONE_PHASE
    };

    /// `PROOF_BOUND=large`: more time, and a second crash.
    pub const LARGE: Bounds = Bounds {
        ticks: 5,
        crashes: 2,
        ..Bounds::CI
    };

    /// `PROOF_BOUND=large`, the outbox's check: more time and crashes.
    pub const LARGE_OUTBOX: Bounds = Bounds {
        ticks: 6,
        crashes: 2,
        ..Bounds::CI_OUTBOX
    };
}

/// A request's state, as its client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Client {
    /// Not sent yet, or answered with something worth a retry (409, 503, a
    /// 5xx, a connection cut by a crash): `left` attempts remain.
    Ready { left: u8 },
    /// On a server now.
    Sent { left: u8 },
    /// Answered: the handler's response, or its replay.
    Done,
    /// Out of attempts.
    GaveUp,
}

/// What a server is doing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Server {
    Idle,
    /// Holds `key` under `token`: the handler runs.
    Running {
        req: u8,
        key: u8,
        token: u8,
        /// The handler's effect: applied (separate) or written in the open
        /// transaction (transactional).
        effect: bool,
        /// The claim's time by this server's own clock (real ticks).
        claimed: u8,
        /// The lease's end by this server's own clock.
        lease_end: u8,
        /// The store's clock stepped back while this server held the key.
        stepped: bool,
        /// One phase: the claim is in the open transaction, not committed.
        inside: bool,
    },
    /// Its claim met another's open claim of `key` (one phase) and waits
    /// on its row lock, since `since` by this server's own clock.
    Waiting {
        req: u8,
        key: u8,
        since: u8,
    },
    /// Only under [`Mutation::EnqueueOutsideTransaction`]: the effect has
    /// committed, its message is still to be written.
    Enqueue {
        req: u8,
        key: u8,
        token: u8,
        /// Transactional mode: the commit was the completion too.
        completed: bool,
        claimed: u8,
        lease_end: u8,
        stepped: bool,
    },
}

/// One idempotency record (`src/store/mod.rs`, `src/store/decide.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Record {
    pub token: u8,
    pub completed: bool,
    /// The token of the holder whose response is stored.
    pub stored_by: u8,
    pub lease_until: u8,
    pub expires_at: u8,
    // Ghosts: what the properties need, never read by the protocol.
    /// The store's time of the last claim or renewal.
    pub lease_set: u8,
    /// The holder of `token` crashed.
    pub crashed: bool,
    /// The clock stepped back since `lease_set`.
    pub stepped: bool,
    /// Written by a claim in one phase.
    pub one_phase: bool,
    /// The holder of `token`, in one phase, ended without committing
    /// (crashed, rolled back, held past its max hold).
    pub ended: bool,
}

/// One outbox row (`crates/outbox/src/queue.rs`, `sql.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Row {
    /// The message's key: derived from the request's key (`message_key`).
    pub key: u8,
    pub body: u8,
    pub state: RowState,
    pub attempts: u8,
    /// The relay lease's deadline on the store's clock; `None`: unleased.
    pub lease_until: Option<u8>,
    /// Ghost: the downstream applied it at least once.
    pub received: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RowState {
    Pending,
    Done,
    Dead,
}

/// What a relay is doing with the one message it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Relay {
    Idle,
    /// Claimed `row` as attempt `attempt` with `lease_until`; `since` is the
    /// claim's time on the relay's own clock.
    Claimed {
        row: u8,
        attempt: u8,
        lease_until: u8,
        since: u8,
    },
    /// Sent; the downstream has not answered. `received`: it applied the
    /// message and its answer will come too late (or it hangs, `false`).
    Waiting {
        row: u8,
        attempt: u8,
        lease_until: u8,
        since: u8,
        received: bool,
    },
    /// The attempt is over; its outcome is still to be recorded.
    Answered {
        row: u8,
        attempt: u8,
        lease_until: u8,
        delivered: bool,
    },
}

impl Relay {
    fn sending(&self) -> Option<u8> {
        match *self {
            Relay::Waiting { row, .. } => Some(row),
            _ => None,
        }
    }
}

/// The whole system.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct State {
    /// Real time (every process's own clock).
    pub ticks: u8,
    /// The store's clock.
    pub now: u8,
    pub stepped: bool,
    pub crashes_left: u8,
    pub next_token: u8,
    pub clients: Vec<Client>,
    pub servers: Vec<Server>,
    /// The committed records.
    pub records: Vec<Option<Record>>,
    /// One phase: per key, the claim written inside an open transaction,
    /// uncommitted. Other claims meet it only as the row's lock; a rollback
    /// leaves the committed record as it was. Empty in the other modes
    /// (nothing to clone and hash in their many states).
    pub open: Vec<Option<Record>>,
    pub rows: Vec<Row>,
    pub relays: Vec<Relay>,
    pub ghost: Ghost,
}

/// What happened, for the properties: counts and the first violation of
/// each rule, set where it happens.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Ghost {
    /// Effects committed per key (since the key's record last expired).
    pub effects: Vec<u8>,
    /// Effects committed per key, whatever the TTL.
    pub effects_total: Vec<u8>,
    /// A second effect of the key is explained by the documented window: a
    /// holder crashed after its effect, or ran past its lease, or the
    /// clock stepped back under it.
    pub excused: Vec<bool>,
    /// A holder of the key crashed between its effect and its completion
    /// (separate mode).
    pub crash_window: Vec<bool>,
    /// A second effect came through the crash window.
    pub doubled_after_crash: bool,
    /// A completion was fenced.
    pub fenced: bool,
    /// A stale holder's completion or release changed a record.
    pub stale_write: bool,
    /// A replay of a response stored by another token than the record's.
    pub foreign_replay: bool,
    /// A retry one lease after its holder's crash was refused in flight.
    pub retry_refused: bool,
    /// A refusal in flight asked for more than one lease.
    pub long_wait: bool,
    /// A holder within its own lease was fenced.
    pub live_holder_fenced: bool,
    /// A message reached the downstream with another body than its key's.
    pub wrong_body: bool,
    /// One phase: a claim was refused in flight by the claim of a holder
    /// that had ended (the key was not freed with its transaction).
    pub kept_after_end: bool,
    /// One phase: the key and the tick of the last crash of a holder.
    pub crashed_at: Option<(u8, u8)>,
    /// One phase: a claim completed in the tick of its key's holder's
    /// crash, no lease waited for.
    pub freed_at_once: bool,
    /// Claims that waited on an open claim: one replayed its commit, one
    /// took the key after its rollback, one was refused at its bound.
    pub waited_replayed: bool,
    pub waited_claimed: bool,
    pub waited_refused: bool,
}

/// A step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Request `req`'s next attempt reaches `server`, which claims its key.
    Claim { req: u8, server: u8 },
    /// The handler on `server` applies its effect.
    Effect { server: u8 },
    /// `server` completes the record (transactional: commits; in one
    /// phase, the claim with it).
    Complete { server: u8 },
    /// The handler failed before any effect (a 5xx): the key is released
    /// (in one phase, the transaction rolled back with its claim).
    Release { server: u8 },
    /// `server` renews its lease.
    Renew { server: u8 },
    /// `server` writes the outbox message after the commit (mutation only).
    Enqueue { server: u8 },
    /// `server` dies: its memory is lost, an open transaction rolled back.
    CrashServer { server: u8 },
    /// The store rolls the open transaction (one phase) of `server` back:
    /// its max hold has passed (`src/store/kit/two_phase.rs`, `end_past`).
    MaxHold { server: u8 },
    /// The open claim `server` waits on has ended: its claim goes on.
    LockFreed { server: u8 },
    /// `server`'s wait reached its bound: 409.
    WaitBound { server: u8 },
    /// `relay` claims row `row`.
    RelayClaim { relay: u8, row: u8 },
    /// `relay` sends; the downstream answers as `answer` says.
    Send { relay: u8, answer: Answer },
    /// The relay's answer timeout ends a hung or late attempt.
    Timeout { relay: u8 },
    /// `relay` records the attempt's outcome (`finish`).
    Finish { relay: u8 },
    /// `relay` dies: its lease on the message stays until it ends.
    CrashRelay { relay: u8 },
    /// Time passes.
    Tick,
    /// The store's clock steps back by [`Bounds::step`].
    StepBack,
}

/// How the downstream answers a send.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// Applies it and answers in time.
    Delivered,
    /// Fails at once, nothing applied.
    Fails,
    /// Never answers, nothing applied: the timeout ends it.
    Hangs,
    /// Applies it, but answers after the timeout.
    Late,
}

/// The model: a mode, a mutation and the bounds.
#[derive(Debug, Clone, Copy)]
pub struct Protocol {
    pub mode: Mode,
    pub mutation: Mutation,
    pub bounds: Bounds,
}

/// What a server running a handler holds ([`Server::Running`]).
struct Holder {
    req: u8,
    key: u8,
    token: u8,
    lease_end: u8,
    stepped: bool,
    inside: bool,
}

/// One phase: the claim of `key` in an open transaction, if any.
fn open_claim(s: &State, key: u8) -> Option<Record> {
    s.open.get(key as usize).copied().flatten()
}

/// The message body of key `key`'s effect: the same on every attempt.
fn body_of(key: u8) -> u8 {
    10 + key
}

impl Protocol {
    fn key_of(&self, req: u8) -> u8 {
        req % self.bounds.keys
    }

    /// `src/store/decide.rs`, `lease_alive`: the deadline is ahead, and no
    /// further ahead than one lease.
    fn lease_alive(&self, lease_until: u8, now: u8) -> bool {
        match self.mutation {
            Mutation::TakeoverWhileLeaseAlive => false,
            Mutation::LeaseTrustsSteppedClock => lease_until > now,
            _ => lease_until > now && lease_until - now <= self.bounds.lease,
        }
    }

    /// Whether `token`'s write may change `record` (`complete`, `release`,
    /// `renew` and the commit: only the current holder's, in flight).
    fn fenced_ok(&self, record: &Record, token: u8, ignore_token: bool) -> bool {
        !record.completed && (ignore_token || record.token == token)
    }

    /// Whether request `req` claims in one phase, inside the handler's
    /// transaction (else its claim commits first).
    fn inside(&self, req: u8) -> bool {
        self.mode == Mode::TransactionalOnePhase && req >= self.bounds.commit_first
    }

    /// Whether another open transaction holds key `key`'s row (one phase):
    /// a write of it by `token` waits for that transaction to end.
    fn locked_by_other(&self, s: &State, key: u8, token: u8) -> bool {
        open_claim(s, key).is_some_and(|r| r.token != token)
    }

    /// Request `req`'s next attempt reaches `server`, which claims its key.
    fn claim(&self, s: &mut State, req: u8, server: u8) {
        let Client::Ready { left } = s.clients[req as usize] else {
            unreachable!()
        };
        s.clients[req as usize] = Client::Sent { left: left - 1 };
        let key = self.key_of(req);
        let k = key as usize;
        // `read_first`: a completed record is answered by a read, which no
        // row lock holds up.
        let readable = s.records[k].is_some_and(|r| r.completed && r.expires_at > s.now);
        if open_claim(s, key).is_some() && !readable {
            // `crates/postgres/src/inside.rs`, `crates/sqlx/src/postgres/inside.rs`:
            // the insert (or the claim that commits first) meets another
            // transaction's uncommitted claim, and waits on its row lock.
            s.servers[server as usize] = Server::Waiting {
                req,
                key,
                since: s.ticks,
            };
            return;
        }
        self.judge(s, req, server, false);
    }

    /// The one atomic claim of request `req` (already sent) on `server`,
    /// once no open transaction holds its key (or a read answers it): the
    /// table of `src/store/mod.rs`, on the committed record. `waited`: after
    /// a wait on another's open claim.
    fn judge(&self, s: &mut State, req: u8, server: u8, waited: bool) {
        let k = self.key_of(req) as usize;
        let now = s.now;
        s.servers[server as usize] = Server::Idle;
        match s.records[k] {
            Some(r) if r.expires_at <= now => {
                // Past its TTL: a new record, and a new count of effects.
                s.ghost.effects[k] = 0;
                s.ghost.excused[k] = false;
                s.ghost.crash_window[k] = false;
                self.excuse_takeover(s, k);
            }
            Some(r) if r.completed => {
                if r.stored_by != r.token {
                    s.ghost.foreign_replay = true;
                }
                s.ghost.waited_replayed |= waited;
                self.answer(s, req, true);
                return;
            }
            Some(r) if self.lease_alive(r.lease_until, now) => {
                if r.lease_until - now > self.bounds.lease {
                    s.ghost.long_wait = true;
                }
                if r.crashed && !r.stepped && now >= r.lease_set + self.bounds.lease {
                    s.ghost.retry_refused = true;
                }
                // `src/store/kit/one_phase.rs`: a crash or a rollback frees
                // a claim in one phase at once.
                if r.one_phase && r.ended {
                    s.ghost.kept_after_end = true;
                }
                self.answer(s, req, false);
                return;
            }
            // Taken over: its holder is stale from now on.
            Some(_) => self.excuse_takeover(s, k),
            None => {}
        }
        s.ghost.waited_claimed |= waited;
        self.acquire(s, req, server);
    }

    /// Request `req` holds its key on `server`, under a fresh token. In one
    /// phase the claim is written inside the open transaction (a takeover
    /// too: a rollback leaves the record it took over as it was).
    fn acquire(&self, s: &mut State, req: u8, server: u8) {
        let key = self.key_of(req);
        let (now, bounds) = (s.now, self.bounds);
        let inside = self.inside(req);
        let token = s.next_token;
        s.next_token += 1;
        let record = Record {
            token,
            completed: false,
            stored_by: 0,
            lease_until: now + bounds.lease,
            expires_at: now + bounds.ttl,
            lease_set: now,
            crashed: false,
            stepped: false,
            one_phase: inside,
            ended: false,
        };
        if inside && self.mutation != Mutation::OnePhaseClaimCommittedBeforeWork {
            s.open[key as usize] = Some(record);
        } else {
            s.records[key as usize] = Some(record);
        }
        s.servers[server as usize] = Server::Running {
            req,
            key,
            token,
            effect: false,
            claimed: s.ticks,
            lease_end: s.ticks + bounds.lease,
            stepped: false,
            inside,
        };
    }

    /// A takeover of key `k`: if its holder is still running past its own
    /// lease (or the clock stepped under it), a second effect in separate
    /// mode is the documented window (a run longer than its lease), not a bug.
    fn excuse_takeover(&self, s: &mut State, k: usize) {
        let ticks = s.ticks;
        for server in &s.servers {
            if let Server::Running {
                key,
                lease_end,
                stepped,
                ..
            } = *server
                && key as usize == k
                && (ticks >= lease_end || stepped)
            {
                s.ghost.excused[k] = true;
            }
        }
    }

    fn commit_effect(&self, s: &mut State, key: u8, enqueue: bool) {
        let k = key as usize;
        s.ghost.effects[k] += 1;
        s.ghost.effects_total[k] += 1;
        if s.ghost.effects[k] > 1 && s.ghost.crash_window[k] {
            s.ghost.doubled_after_crash = true;
        }
        if enqueue {
            self.enqueue(s, key);
        }
    }

    fn enqueue(&self, s: &mut State, key: u8) {
        s.rows.push(Row {
            key,
            body: body_of(key),
            state: RowState::Pending,
            attempts: 0,
            lease_until: None,
            received: false,
        });
    }

    fn answer(&self, s: &mut State, req: u8, ok: bool) {
        let Client::Sent { left } = s.clients[req as usize] else {
            unreachable!()
        };
        s.clients[req as usize] = if ok {
            Client::Done
        } else if left == 0 {
            Client::GaveUp
        } else {
            Client::Ready { left }
        };
    }

    /// What `server`, running a handler, holds.
    fn holder(&self, s: &State, server: u8) -> Holder {
        let Server::Running {
            req,
            key,
            token,
            lease_end,
            stepped,
            inside,
            ..
        } = s.servers[server as usize]
        else {
            unreachable!()
        };
        Holder {
            req,
            key,
            token,
            lease_end,
            stepped,
            inside,
        }
    }

    /// A holder finishing within its own lease (by its own clock, no step
    /// under it) must not be fenced.
    fn check_live_fence(&self, s: &mut State, lease_end: u8, stepped: bool) {
        s.ghost.fenced = true;
        if s.ticks < lease_end && !stepped {
            s.ghost.live_holder_fenced = true;
        }
    }

    /// `server` completes its record: separate mode's second write, or
    /// the transactional commit of the effect, its message and the
    /// completion, fenced by the token (in one phase, the claim's too).
    fn complete(&self, s: &mut State, server: u8) {
        let h = self.holder(s, server);
        let k = h.key as usize;
        let writes = if open_claim(s, h.key).is_some_and(|r| r.token == h.token) {
            // One phase: the claim commits with the completion.
            let mut r = s.open[k].take().unwrap();
            r.completed = true;
            r.stored_by = h.token;
            s.records[k] = Some(r);
            true
        } else {
            self.complete_committed(s, &h)
        };
        s.servers[server as usize] = Server::Idle;
        if self.mode == Mode::Separate {
            // The effect is committed already; the response goes out either
            // way (a fenced completion is logged).
            self.answer(s, h.req, true);
            return;
        }
        if !writes {
            // Fenced: rolled back, 503.
            self.answer(s, h.req, false);
            return;
        }
        if h.inside && s.ghost.crashed_at == Some((h.key, s.ticks)) {
            s.ghost.freed_at_once = true;
        }
        let outside = self.mutation == Mutation::EnqueueOutsideTransaction;
        self.commit_effect(s, h.key, !outside);
        if outside {
            s.servers[server as usize] = Server::Enqueue {
                req: h.req,
                key: h.key,
                token: h.token,
                completed: true,
                claimed: 0,
                lease_end: h.lease_end,
                stepped: h.stepped,
            };
            return;
        }
        self.answer(s, h.req, true);
    }

    /// The completion of a committed claim, fenced by the token: whether
    /// it was written.
    fn complete_committed(&self, s: &mut State, h: &Holder) -> bool {
        let k = h.key as usize;
        let ignore = self.mutation == Mutation::CompleteIgnoresToken;
        let writes = s.records[k].is_some_and(|r| self.fenced_ok(&r, h.token, ignore));
        if writes {
            let r = s.records[k].as_mut().unwrap();
            if r.token != h.token {
                s.ghost.stale_write = true;
            }
            r.completed = true;
            r.stored_by = h.token;
        } else {
            self.check_live_fence(s, h.lease_end, h.stepped);
        }
        writes
    }

    /// The handler failed before any effect (a 5xx): the claim is given
    /// back, or in one phase rolled back with the transaction.
    fn release(&self, s: &mut State, server: u8) {
        let h = self.holder(s, server);
        let k = h.key as usize;
        s.servers[server as usize] = Server::Idle;
        if h.inside {
            self.roll_back_inside(s, h.key, h.token);
            self.answer(s, h.req, false);
            return;
        }
        let ignore = self.mutation == Mutation::ReleaseWithoutToken;
        let deletes = s.records[k].is_some_and(|r| self.fenced_ok(&r, h.token, ignore));
        if deletes {
            if s.records[k].unwrap().token != h.token {
                s.ghost.stale_write = true;
            }
            s.records[k] = None;
        } else {
            self.check_live_fence(s, h.lease_end, h.stepped);
        }
        self.answer(s, h.req, false);
    }

    /// One phase: the open transaction of `token` on `key` is rolled back
    /// (a 5xx, a crash, the max hold), and its claim with it: nothing is
    /// given back (`src/store/kit/one_phase.rs`). Under the planted bug the
    /// claim committed before the work, and stays in flight.
    fn roll_back_inside(&self, s: &mut State, key: u8, token: u8) {
        let k = key as usize;
        if open_claim(s, key).is_some_and(|r| r.token == token) {
            s.open[k] = None;
        } else if let Some(r) = s.records[k].as_mut()
            && r.token == token
            && !r.completed
        {
            r.ended = true;
        }
    }

    /// One phase: the store rolls `server`'s transaction back past its max
    /// hold (`src/store/kit/two_phase.rs`, `end_past`): 503.
    fn max_hold(&self, s: &mut State, server: u8) {
        let h = self.holder(s, server);
        self.roll_back_inside(s, h.key, h.token);
        s.servers[server as usize] = Server::Idle;
        self.answer(s, h.req, false);
    }

    /// `server`'s wait reached its bound: 409, the client retries.
    fn wait_bound(&self, s: &mut State, server: u8) {
        let Server::Waiting { req, .. } = s.servers[server as usize] else {
            unreachable!()
        };
        s.ghost.waited_refused = true;
        s.servers[server as usize] = Server::Idle;
        self.answer(s, req, false);
    }

    fn crash_server(&self, s: &mut State, server: u8) {
        match s.servers[server as usize] {
            Server::Running {
                req,
                key,
                token,
                effect,
                inside,
                ..
            } => {
                let k = key as usize;
                if let Some(r) = s.records[k].as_mut()
                    && r.token == token
                {
                    r.crashed = true;
                }
                // Separate: the effect stays, its record in flight: the
                // documented window. Transactional: rolled back.
                if effect && self.mode == Mode::Separate {
                    s.ghost.excused[k] = true;
                    s.ghost.crash_window[k] = true;
                }
                if inside {
                    self.roll_back_inside(s, key, token);
                    s.ghost.crashed_at = Some((key, s.ticks));
                }
                self.answer(s, req, false);
            }
            Server::Enqueue {
                req,
                key,
                completed,
                ..
            } => {
                // Separate mode: the effect committed, its record in flight.
                if !completed && self.mode == Mode::Separate {
                    s.ghost.excused[key as usize] = true;
                    s.ghost.crash_window[key as usize] = true;
                }
                self.answer(s, req, false)
            }
            // Its wait ends with its connection.
            Server::Waiting { req, .. } => self.answer(s, req, false),
            Server::Idle => unreachable!(),
        }
        s.servers[server as usize] = Server::Idle;
        s.crashes_left -= 1;
    }

    fn relay_claim(&self, s: &mut State, relay: u8, row: u8) {
        let now = s.now;
        let r = &mut s.rows[row as usize];
        r.attempts += 1;
        r.lease_until = Some(now + self.bounds.relay_lease);
        s.relays[relay as usize] = Relay::Claimed {
            row,
            attempt: r.attempts,
            lease_until: now + self.bounds.relay_lease,
            since: s.ticks,
        };
    }

    fn receive(&self, s: &mut State, row: u8) {
        let r = &mut s.rows[row as usize];
        if r.body != body_of(r.key) {
            s.ghost.wrong_body = true;
        }
        r.received = true;
    }

    /// `Queue::finish`: done while pending; a retry or a dead letter only
    /// for the same attempt and lease (`sql.rs`).
    fn finish(&self, s: &mut State, row: u8, attempt: u8, lease_until: u8, delivered: bool) {
        let max = self.bounds.max_attempts;
        let r = &mut s.rows[row as usize];
        if r.state != RowState::Pending {
            return;
        }
        if delivered {
            r.state = RowState::Done;
            r.lease_until = None;
        } else if r.attempts == attempt && r.lease_until == Some(lease_until) {
            if attempt >= max {
                r.state = RowState::Dead;
            }
            r.lease_until = None;
        }
    }

    /// Where a renewal at `ticks` puts the lease's end, by the holder's clock.
    fn renewed_end(&self, ticks: u8, claimed: u8) -> u8 {
        (ticks + self.bounds.lease).min(claimed + self.bounds.max_hold)
    }

    fn tick_allowed(&self, s: &State) -> bool {
        let b = self.bounds;
        if s.ticks >= b.ticks {
            return false;
        }
        // The relay honours its lease: an attempt ends within the answer
        // timeout of its claim (below the lease), so a relay that claimed
        // or is waiting past it acts before time moves on.
        let relay_due = s.relays.iter().any(|r| match *r {
            Relay::Claimed { since, .. } | Relay::Waiting { since, .. } => {
                s.ticks >= since + b.answer_timeout
            }
            _ => false,
        });
        // One phase: the database ends a lock wait at its bound (unless the
        // bound is not in force), and the store rolls a transaction back at
        // its max hold, before time moves on.
        let server_due = s.servers.iter().any(|sv| match *sv {
            Server::Waiting { since, .. } => {
                self.mutation != Mutation::WaitIgnoresBound && s.ticks >= since + b.wait
            }
            Server::Running {
                inside: true,
                claimed,
                ..
            } => s.ticks >= claimed + b.max_hold,
            _ => false,
        });
        !relay_due && !server_due
    }

    /// The actions of `server`.
    fn server_actions(&self, s: &State, server: u8, actions: &mut Vec<Action>) {
        let b = self.bounds;
        match s.servers[server as usize] {
            Server::Running {
                effect,
                claimed,
                lease_end,
                token,
                key,
                inside,
                ..
            } => {
                // A write of the record waits while another open
                // transaction holds its row.
                let free = !self.locked_by_other(s, key, token);
                if !effect {
                    actions.push(Action::Effect { server });
                    if free {
                        actions.push(Action::Release { server });
                    }
                } else if free {
                    actions.push(Action::Complete { server });
                }
                let holds =
                    s.records[key as usize].is_some_and(|r| self.fenced_ok(&r, token, false));
                // `src/renew.rs`: no renewal at or past the max hold; none
                // for a claim in one phase.
                if inside {
                    if s.ticks >= claimed + b.max_hold {
                        actions.push(Action::MaxHold { server });
                    }
                } else if free
                    && holds
                    && s.ticks < claimed + b.max_hold
                    && self.renewed_end(s.ticks, claimed) > lease_end
                {
                    actions.push(Action::Renew { server });
                }
            }
            Server::Waiting { key, since, .. } => {
                if open_claim(s, key).is_none() {
                    actions.push(Action::LockFreed { server });
                }
                if self.mutation != Mutation::WaitIgnoresBound && s.ticks >= since + b.wait {
                    actions.push(Action::WaitBound { server });
                }
            }
            Server::Enqueue { .. } => actions.push(Action::Enqueue { server }),
            Server::Idle => return,
        }
        if s.crashes_left > 0 {
            actions.push(Action::CrashServer { server });
        }
    }

    /// The relays' actions.
    fn relay_actions(&self, s: &State, actions: &mut Vec<Action>) {
        let free_relay = s.relays.iter().position(|r| *r == Relay::Idle);
        for (i, row) in s.rows.iter().enumerate() {
            let due = row.state == RowState::Pending
                && row.lease_until.is_none_or(|until| until <= s.now);
            if let (true, Some(relay)) = (due, free_relay) {
                actions.push(Action::RelayClaim {
                    relay: relay as u8,
                    row: i as u8,
                });
            }
        }
        for (i, relay) in s.relays.iter().enumerate() {
            let relay_id = i as u8;
            match *relay {
                Relay::Idle => continue,
                Relay::Claimed { .. } => {
                    for answer in [
                        Answer::Delivered,
                        Answer::Fails,
                        Answer::Hangs,
                        Answer::Late,
                    ] {
                        actions.push(Action::Send {
                            relay: relay_id,
                            answer,
                        });
                    }
                }
                Relay::Waiting { since, .. } => {
                    if s.ticks >= since + self.bounds.answer_timeout {
                        actions.push(Action::Timeout { relay: relay_id });
                    }
                }
                Relay::Answered { .. } => actions.push(Action::Finish { relay: relay_id }),
            }
            if s.crashes_left > 0 {
                actions.push(Action::CrashRelay { relay: relay_id });
            }
        }
    }

    /// The handler on `server` applies its effect: committed at once in
    /// separate mode, written in the open transaction otherwise.
    fn effect(&self, s: &mut State, server: u8) {
        let Server::Running {
            req,
            key,
            token,
            effect,
            claimed,
            lease_end,
            stepped,
            ..
        } = &mut s.servers[server as usize]
        else {
            unreachable!()
        };
        *effect = true;
        let (req, key, token, claimed, lease_end, stepped) =
            (*req, *key, *token, *claimed, *lease_end, *stepped);
        if self.mode != Mode::Separate {
            return;
        }
        // The handler's own commit: the effect and its message.
        let outside = self.mutation == Mutation::EnqueueOutsideTransaction;
        self.commit_effect(s, key, !outside);
        if outside {
            s.servers[server as usize] = Server::Enqueue {
                req,
                key,
                token,
                completed: false,
                claimed,
                lease_end,
                stepped,
            };
        }
    }

    /// `server` renews its lease (`src/renew.rs`): one lease from now,
    /// never past the max hold.
    fn renew(&self, s: &mut State, server: u8) {
        let (ticks, now) = (s.ticks, s.now);
        let Server::Running {
            key,
            token,
            claimed,
            lease_end,
            ..
        } = &mut s.servers[server as usize]
        else {
            unreachable!()
        };
        let end = self.renewed_end(ticks, *claimed);
        let r = s.records[*key as usize].as_mut().unwrap();
        debug_assert_eq!(r.token, *token);
        r.lease_until = now + (end - ticks);
        r.lease_set = now;
        r.stepped = false;
        *lease_end = end;
    }

    /// `server` writes the outbox message after the commit (mutation only).
    fn enqueue_late(&self, s: &mut State, server: u8) {
        let Server::Enqueue {
            req,
            key,
            token,
            completed,
            claimed,
            lease_end,
            stepped,
        } = s.servers[server as usize]
        else {
            unreachable!()
        };
        self.enqueue(s, key);
        if completed {
            s.servers[server as usize] = Server::Idle;
            self.answer(s, req, true);
        } else {
            // Separate mode: back to the handler, which completes.
            s.servers[server as usize] = Server::Running {
                req,
                key,
                token,
                effect: true,
                claimed,
                lease_end,
                stepped,
                inside: false,
            };
        }
    }

    /// `relay` sends; the downstream answers as `answer` says.
    fn send(&self, s: &mut State, relay: u8, answer: Answer) {
        let Relay::Claimed {
            row,
            attempt,
            lease_until,
            since,
        } = s.relays[relay as usize]
        else {
            unreachable!()
        };
        if self.mutation == Mutation::AckBeforeSend {
            self.finish(s, row, attempt, lease_until, true);
        }
        s.relays[relay as usize] = match answer {
            Answer::Delivered | Answer::Fails => {
                let delivered = answer == Answer::Delivered;
                if delivered {
                    self.receive(s, row);
                }
                Relay::Answered {
                    row,
                    attempt,
                    lease_until,
                    delivered,
                }
            }
            Answer::Hangs | Answer::Late => Relay::Waiting {
                row,
                attempt,
                lease_until,
                since,
                received: answer == Answer::Late,
            },
        };
    }

    /// The relay's answer timeout ends a hung or late attempt.
    fn timeout(&self, s: &mut State, relay: u8) {
        let Relay::Waiting {
            row,
            attempt,
            lease_until,
            received,
            ..
        } = s.relays[relay as usize]
        else {
            unreachable!()
        };
        if received {
            self.receive(s, row);
        }
        s.relays[relay as usize] = Relay::Answered {
            row,
            attempt,
            lease_until,
            delivered: false,
        };
    }

    /// `relay` records the attempt's outcome.
    fn record_outcome(&self, s: &mut State, relay: u8) {
        let Relay::Answered {
            row,
            attempt,
            lease_until,
            delivered,
        } = s.relays[relay as usize]
        else {
            unreachable!()
        };
        self.finish(s, row, attempt, lease_until, delivered);
        s.relays[relay as usize] = Relay::Idle;
    }

    /// The store's clock steps back by [`Bounds::step`].
    fn step_back(&self, s: &mut State) {
        s.now -= self.bounds.step;
        s.stepped = true;
        for r in s.records.iter_mut().flatten() {
            r.stepped = true;
        }
        for server in &mut s.servers {
            if let Server::Running { stepped, .. } = server {
                *stepped = true;
            }
        }
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let b = self.bounds;
        let keys = b.keys as usize;
        vec![State {
            ticks: 0,
            now: 0,
            stepped: false,
            crashes_left: b.crashes,
            next_token: 1,
            clients: vec![Client::Ready { left: b.attempts }; b.requests as usize],
            servers: vec![Server::Idle; b.servers as usize],
            records: vec![None; keys],
            open: if self.mode == Mode::TransactionalOnePhase {
                vec![None; keys]
            } else {
                Vec::new()
            },
            rows: Vec::new(),
            relays: vec![Relay::Idle; b.relays as usize],
            ghost: Ghost {
                effects: vec![0; keys],
                effects_total: vec![0; keys],
                excused: vec![false; keys],
                crash_window: vec![false; keys],
                ..Ghost::default()
            },
        }]
    }

    fn actions(&self, s: &State, actions: &mut Vec<Action>) {
        let b = self.bounds;
        // The first idle server takes the request: servers are alike.
        let idle = s.servers.iter().position(|sv| *sv == Server::Idle);
        for (req, client) in s.clients.iter().enumerate() {
            if let (Client::Ready { .. }, Some(server)) = (client, idle) {
                actions.push(Action::Claim {
                    req: req as u8,
                    server: server as u8,
                });
            }
        }
        for server in 0..b.servers {
            self.server_actions(s, server, actions);
        }
        self.relay_actions(s, actions);
        if self.tick_allowed(s) {
            actions.push(Action::Tick);
        }
        if !s.stepped && b.step > 0 && s.now >= b.step {
            actions.push(Action::StepBack);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        match action {
            Action::Claim { req, server } => self.claim(&mut s, req, server),
            Action::Effect { server } => self.effect(&mut s, server),
            Action::Complete { server } => self.complete(&mut s, server),
            Action::Release { server } => self.release(&mut s, server),
            Action::Renew { server } => self.renew(&mut s, server),
            Action::Enqueue { server } => self.enqueue_late(&mut s, server),
            Action::CrashServer { server } => self.crash_server(&mut s, server),
            Action::MaxHold { server } => self.max_hold(&mut s, server),
            Action::LockFreed { server } => {
                let Server::Waiting { req, .. } = s.servers[server as usize] else {
                    unreachable!()
                };
                self.judge(&mut s, req, server, true);
            }
            Action::WaitBound { server } => self.wait_bound(&mut s, server),
            Action::RelayClaim { relay, row } => self.relay_claim(&mut s, relay, row),
            Action::Send { relay, answer } => self.send(&mut s, relay, answer),
            Action::Timeout { relay } => self.timeout(&mut s, relay),
            Action::Finish { relay } => self.record_outcome(&mut s, relay),
            Action::CrashRelay { relay } => {
                s.relays[relay as usize] = Relay::Idle;
                s.crashes_left -= 1;
            }
            Action::Tick => {
                s.ticks += 1;
                s.now += 1;
            }
            Action::StepBack => self.step_back(&mut s),
        }
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = safety();
        properties.extend(reachability());
        match self.mode {
            Mode::Separate => properties.push(Property::sometimes(
                "separate mode can double an effect after a crash",
                |_: &Protocol, s: &State| s.ghost.doubled_after_crash,
            )),
            Mode::Transactional => {}
            Mode::TransactionalOnePhase => properties.extend(one_phase()),
        }
        properties
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }
}

/// The properties every mode keeps.
fn safety() -> Vec<Property<Protocol>> {
    vec![
        Property::always(
            "transactional mode applies at most one effect per key",
            |m: &Protocol, s: &State| {
                m.mode == Mode::Separate || s.ghost.effects.iter().all(|&n| n <= 1)
            },
        ),
        Property::always(
            "separate mode applies a second effect only through its documented window",
            |m: &Protocol, s: &State| {
                m.mode != Mode::Separate
                    || s.ghost
                        .effects
                        .iter()
                        .zip(&s.ghost.excused)
                        .all(|(&n, &excused)| n <= 1 || excused)
            },
        ),
        Property::always(
            "no response is replayed unless it was stored by the holder of the current token",
            |_: &Protocol, s: &State| !s.ghost.foreign_replay,
        ),
        Property::always(
            "a stale holder never completes or releases",
            |_: &Protocol, s: &State| !s.ghost.stale_write,
        ),
        Property::always(
            "every committed effect's outbox message is delivered at least once, always with the same key and body",
            |_: &Protocol, s: &State| outbox_holds(s),
        ),
        Property::always(
            "no message is being sent by two relays at once while both leases are honoured",
            |_: &Protocol, s: &State| {
                let sending: Vec<u8> = s.relays.iter().filter_map(Relay::sending).collect();
                sending
                    .iter()
                    .enumerate()
                    .all(|(i, row)| !sending[i + 1..].contains(row))
            },
        ),
        Property::always(
            "liveness: with the store reachable, a retry after any crash completes within one lease plus its own run",
            |_: &Protocol, s: &State| {
                !(s.ghost.retry_refused || s.ghost.long_wait || s.ghost.live_holder_fenced)
            },
        ),
    ]
}

/// Reachability: the model is not vacuous.
fn reachability() -> Vec<Property<Protocol>> {
    vec![
        Property::sometimes(
            "a retry after a crash completes",
            |_: &Protocol, s: &State| {
                s.ghost.effects_total.iter().any(|&n| n >= 1)
                    && s.crashes_left == 0
                    && s.clients.iter().all(|c| *c == Client::Done)
            },
        ),
        Property::sometimes(
            "a message is delivered after a hung attempt",
            |_: &Protocol, s: &State| {
                s.rows
                    .iter()
                    .any(|r| r.state == RowState::Done && r.attempts >= 2)
            },
        ),
        Property::sometimes("a stale holder is fenced", |_: &Protocol, s: &State| {
            s.ghost.fenced
        }),
    ]
}

/// One phase's own: its liveness (no lease after a crash), the wait's
/// bound, and that each end of a wait is reached.
fn one_phase() -> Vec<Property<Protocol>> {
    vec![
        Property::always(
            "liveness: in one phase, a crash or a rollback frees the key at once, with no lease to wait for",
            |_: &Protocol, s: &State| !s.ghost.kept_after_end,
        ),
        Property::always(
            "a claim that meets another's open claim is answered within its wait",
            |m: &Protocol, s: &State| {
                s.servers.iter().all(|sv| match *sv {
                    Server::Waiting { since, .. } => s.ticks <= since + m.bounds.wait,
                    _ => true,
                })
            },
        ),
        Property::sometimes(
            "in one phase, a retry completes in the tick of its holder's crash",
            |_: &Protocol, s: &State| s.ghost.freed_at_once,
        ),
        Property::sometimes(
            "a claim that waited on an open claim replays its commit",
            |_: &Protocol, s: &State| s.ghost.waited_replayed,
        ),
        Property::sometimes(
            "a claim that waited on an open claim takes the key after its rollback",
            |_: &Protocol, s: &State| s.ghost.waited_claimed,
        ),
        Property::sometimes(
            "a claim that waited on an open claim is refused at its bound",
            |_: &Protocol, s: &State| s.ghost.waited_refused,
        ),
    ]
}

/// The outbox's side of at-least-once, checked in every state: each
/// committed effect has its message in the outbox (enqueued in the same
/// commit), every message recorded as delivered reached the downstream, and
/// the downstream only ever got a key's own body.
fn outbox_holds(s: &State) -> bool {
    // A message whose write is under way (only under the mutation that
    // writes it after the commit) is not lost yet: a crash loses it.
    let writing = |k: usize| {
        s.servers
            .iter()
            .filter(|sv| matches!(sv, Server::Enqueue { key, .. } if *key as usize == k))
            .count()
    };
    let enqueued = s.ghost.effects_total.iter().enumerate().all(|(k, &n)| {
        s.rows.iter().filter(|r| r.key as usize == k).count() + writing(k) >= n as usize
    });
    let acked_means_received = s
        .rows
        .iter()
        .all(|r| r.state != RowState::Done || r.received);
    enqueued && acked_means_received && !s.ghost.wrong_body
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?} mode, mutation {:?}", self.mode, self.mutation)
    }
}
