//! A model of tower-idempotency's protocol, checked exhaustively with
//! stateright: requests and their retries, servers that claim, renew,
//! complete, release and crash, one store with leases, fencing tokens, a TTL
//! and a clock that can step back once, the two modes, and the outbox's
//! enqueue, relay lease, send and ack against a downstream that fails, hangs
//! and answers late.
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
}

/// One planted bug at a time (issue 24, item 3), or none.
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
}

impl Mutation {
    /// Every planted bug, with the name `PROOF_MUTATION` takes.
    pub const ALL: [(&'static str, Mutation); 6] = [
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
    ];

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
    pub records: Vec<Option<Record>>,
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
}

/// A step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Action {
    /// Request `req`'s next attempt reaches `server`, which claims its key.
    Claim { req: u8, server: u8 },
    /// The handler on `server` applies its effect.
    Effect { server: u8 },
    /// `server` completes the record (transactional: commits).
    Complete { server: u8 },
    /// The handler failed before any effect (a 5xx): the key is released.
    Release { server: u8 },
    /// `server` renews its lease.
    Renew { server: u8 },
    /// `server` writes the outbox message after the commit (mutation only).
    Enqueue { server: u8 },
    /// `server` dies: its memory is lost, an open transaction rolled back.
    CrashServer { server: u8 },
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

    fn claim(&self, s: &mut State, req: u8, server: u8) {
        let key = self.key_of(req);
        let k = key as usize;
        let Client::Ready { left } = s.clients[req as usize] else {
            unreachable!()
        };
        let left = left - 1;
        let now = s.now;
        let bounds = self.bounds;
        // The one atomic claim: the table of `src/store/mod.rs`.
        let acquire = match s.records[k] {
            None => true,
            Some(r) if r.expires_at <= now => {
                // Past its TTL: a new record, and a new count of effects.
                s.ghost.effects[k] = 0;
                s.ghost.excused[k] = false;
                s.ghost.crash_window[k] = false;
                self.excuse_takeover(s, k);
                true
            }
            Some(r) if r.completed => {
                if r.stored_by != r.token {
                    s.ghost.foreign_replay = true;
                }
                s.clients[req as usize] = Client::Done;
                return;
            }
            Some(r) if self.lease_alive(r.lease_until, now) => {
                if r.lease_until - now > bounds.lease {
                    s.ghost.long_wait = true;
                }
                if r.crashed && !r.stepped && now >= r.lease_set + bounds.lease {
                    s.ghost.retry_refused = true;
                }
                s.clients[req as usize] = if left == 0 {
                    Client::GaveUp
                } else {
                    Client::Ready { left }
                };
                return;
            }
            Some(_) => {
                // Taken over: its holder is stale from now on.
                self.excuse_takeover(s, k);
                true
            }
        };
        debug_assert!(acquire);
        let token = s.next_token;
        s.next_token += 1;
        s.records[k] = Some(Record {
            token,
            completed: false,
            stored_by: 0,
            lease_until: now + bounds.lease,
            expires_at: now + bounds.ttl,
            lease_set: now,
            crashed: false,
            stepped: false,
        });
        s.clients[req as usize] = Client::Sent { left };
        s.servers[server as usize] = Server::Running {
            req,
            key,
            token,
            effect: false,
            claimed: s.ticks,
            lease_end: s.ticks + bounds.lease,
            stepped: false,
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

    fn running(&self, s: &State, server: u8) -> Option<(u8, u8, u8, bool, u8, bool)> {
        match s.servers[server as usize] {
            Server::Running {
                req,
                key,
                token,
                effect,
                lease_end,
                stepped,
                ..
            } => Some((req, key, token, effect, lease_end, stepped)),
            _ => None,
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

    fn complete(&self, s: &mut State, server: u8) {
        let (req, key, token, _effect, lease_end, stepped) = self.running(s, server).unwrap();
        let k = key as usize;
        let ignore = self.mutation == Mutation::CompleteIgnoresToken;
        let writes = s.records[k].is_some_and(|r| self.fenced_ok(&r, token, ignore));
        if writes {
            let r = s.records[k].as_mut().unwrap();
            if r.token != token {
                s.ghost.stale_write = true;
            }
            r.completed = true;
            r.stored_by = token;
        } else {
            self.check_live_fence(s, lease_end, stepped);
        }
        s.servers[server as usize] = Server::Idle;
        match self.mode {
            // The effect is committed already; the response goes out either
            // way (a fenced completion is logged).
            Mode::Separate => self.answer(s, req, true),
            Mode::Transactional => {
                if writes {
                    let outside = self.mutation == Mutation::EnqueueOutsideTransaction;
                    self.commit_effect(s, key, !outside);
                    if outside {
                        s.servers[server as usize] = Server::Enqueue {
                            req,
                            key,
                            token,
                            completed: true,
                            claimed: 0,
                            lease_end,
                            stepped,
                        };
                        return;
                    }
                    self.answer(s, req, true);
                } else {
                    // Fenced: rolled back, 503.
                    self.answer(s, req, false);
                }
            }
        }
    }

    fn release(&self, s: &mut State, server: u8) {
        let (req, key, token, _, lease_end, stepped) = self.running(s, server).unwrap();
        let k = key as usize;
        let ignore = self.mutation == Mutation::ReleaseWithoutToken;
        let deletes = s.records[k].is_some_and(|r| self.fenced_ok(&r, token, ignore));
        if deletes {
            if s.records[k].unwrap().token != token {
                s.ghost.stale_write = true;
            }
            s.records[k] = None;
        } else {
            self.check_live_fence(s, lease_end, stepped);
        }
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
        if s.ticks >= self.bounds.ticks {
            return false;
        }
        // The relay honours its lease: an attempt ends within the answer
        // timeout of its claim (below the lease), so a relay that claimed
        // or is waiting past it acts before time moves on.
        !s.relays.iter().any(|r| match *r {
            Relay::Claimed { since, .. } | Relay::Waiting { since, .. } => {
                s.ticks >= since + self.bounds.answer_timeout
            }
            _ => false,
        })
    }
}

impl Model for Protocol {
    type State = State;
    type Action = Action;

    fn init_states(&self) -> Vec<State> {
        let b = self.bounds;
        vec![State {
            ticks: 0,
            now: 0,
            stepped: false,
            crashes_left: b.crashes,
            next_token: 1,
            clients: vec![Client::Ready { left: b.attempts }; b.requests as usize],
            servers: vec![Server::Idle; b.servers as usize],
            records: vec![None; b.keys as usize],
            rows: Vec::new(),
            relays: vec![Relay::Idle; b.relays as usize],
            ghost: Ghost {
                effects: vec![0; b.keys as usize],
                effects_total: vec![0; b.keys as usize],
                excused: vec![false; b.keys as usize],
                crash_window: vec![false; b.keys as usize],
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
        for (i, server) in s.servers.iter().enumerate() {
            let server_id = i as u8;
            match *server {
                Server::Running {
                    effect,
                    claimed,
                    lease_end,
                    token,
                    key,
                    ..
                } => {
                    if !effect {
                        actions.push(Action::Effect { server: server_id });
                        actions.push(Action::Release { server: server_id });
                    } else {
                        actions.push(Action::Complete { server: server_id });
                    }
                    let holds =
                        s.records[key as usize].is_some_and(|r| self.fenced_ok(&r, token, false));
                    // `src/renew.rs`: no renewal at or past the max hold.
                    if holds
                        && s.ticks < claimed + b.max_hold
                        && self.renewed_end(s.ticks, claimed) > lease_end
                    {
                        actions.push(Action::Renew { server: server_id });
                    }
                }
                Server::Enqueue { .. } => actions.push(Action::Enqueue { server: server_id }),
                Server::Idle => continue,
            }
            if s.crashes_left > 0 {
                actions.push(Action::CrashServer { server: server_id });
            }
        }
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
                    if s.ticks >= since + b.answer_timeout {
                        actions.push(Action::Timeout { relay: relay_id });
                    }
                }
                Relay::Answered { .. } => actions.push(Action::Finish { relay: relay_id }),
            }
            if s.crashes_left > 0 {
                actions.push(Action::CrashRelay { relay: relay_id });
            }
        }
        if self.tick_allowed(s) {
            actions.push(Action::Tick);
        }
        if !s.stepped && b.step > 0 && s.now >= b.step {
            actions.push(Action::StepBack);
        }
    }

    fn next_state(&self, last: &State, action: Action) -> Option<State> {
        let mut s = last.clone();
        let b = self.bounds;
        match action {
            Action::Claim { req, server } => self.claim(&mut s, req, server),
            Action::Effect { server } => {
                let Server::Running { key, effect, .. } = &mut s.servers[server as usize] else {
                    unreachable!()
                };
                *effect = true;
                let key = *key;
                if self.mode == Mode::Separate {
                    // The handler's own commit: the effect and its message.
                    let outside = self.mutation == Mutation::EnqueueOutsideTransaction;
                    self.commit_effect(&mut s, key, !outside);
                    if outside {
                        let Server::Running {
                            req,
                            key,
                            token,
                            claimed,
                            lease_end,
                            stepped,
                            ..
                        } = s.servers[server as usize]
                        else {
                            unreachable!()
                        };
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
            }
            Action::Complete { server } => self.complete(&mut s, server),
            Action::Release { server } => self.release(&mut s, server),
            Action::Renew { server } => {
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
                // `src/renew.rs`: one lease from now, never past the max hold.
                let end = self.renewed_end(ticks, *claimed);
                let r = s.records[*key as usize].as_mut().unwrap();
                debug_assert_eq!(r.token, *token);
                r.lease_until = now + (end - ticks);
                r.lease_set = now;
                r.stepped = false;
                *lease_end = end;
            }
            Action::Enqueue { server } => {
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
                self.enqueue(&mut s, key);
                if completed {
                    s.servers[server as usize] = Server::Idle;
                    self.answer(&mut s, req, true);
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
                    };
                }
            }
            Action::CrashServer { server } => self.crash_server(&mut s, server),
            Action::RelayClaim { relay, row } => self.relay_claim(&mut s, relay, row),
            Action::Send { relay, answer } => {
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
                    self.finish(&mut s, row, attempt, lease_until, true);
                }
                s.relays[relay as usize] = match answer {
                    Answer::Delivered | Answer::Fails => {
                        let delivered = answer == Answer::Delivered;
                        if delivered {
                            self.receive(&mut s, row);
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
            Action::Timeout { relay } => {
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
                    self.receive(&mut s, row);
                }
                s.relays[relay as usize] = Relay::Answered {
                    row,
                    attempt,
                    lease_until,
                    delivered: false,
                };
            }
            Action::Finish { relay } => {
                let Relay::Answered {
                    row,
                    attempt,
                    lease_until,
                    delivered,
                } = s.relays[relay as usize]
                else {
                    unreachable!()
                };
                self.finish(&mut s, row, attempt, lease_until, delivered);
                s.relays[relay as usize] = Relay::Idle;
            }
            Action::CrashRelay { relay } => {
                s.relays[relay as usize] = Relay::Idle;
                s.crashes_left -= 1;
            }
            Action::Tick => {
                s.ticks += 1;
                s.now += 1;
            }
            Action::StepBack => {
                s.now -= b.step;
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
        Some(s)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let mut properties = vec![
            Property::always(
                "transactional mode applies at most one effect per key",
                |m: &Protocol, s: &State| {
                    m.mode != Mode::Transactional || s.ghost.effects.iter().all(|&n| n <= 1)
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
            // Reachability: the model is not vacuous.
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
        ];
        if self.mode == Mode::Separate {
            properties.push(Property::sometimes(
                "separate mode can double an effect after a crash",
                |_: &Protocol, s: &State| s.ghost.doubled_after_crash,
            ));
        }
        properties
    }

    fn format_action(&self, action: &Action) -> String {
        format!("{action:?}")
    }
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
