//! A run's plan, all of it from the seed: the keys, their amounts, which
//! ledger each is sent to and when, which are slow and repeated while they
//! run, and the faults with their times and lengths.

use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// The ledgers' lease (`--lease-secs`).
pub const LEASE: Duration = Duration::from_secs(2);
/// Keys sent while faults happen.
const FAULT_PHASE_KEYS: usize = 10;
/// The targeted pause (issue 36, item 5): when, and for how long.
const TARGETED_PAUSE: (Duration, Duration) =
    (Duration::from_millis(800), Duration::from_millis(3500));
/// The other faults start within this after the targeted pause ends.
const FAULTS_WITHIN: Duration = Duration::from_secs(5);
/// After the last fault is healed, nothing explains a 503 this long later.
pub const GRACE: Duration = Duration::from_millis(1500);

#[derive(Debug, Clone)]
pub struct KeyPlan {
    pub key: String,
    /// Unique per key, so each credit row names its key.
    pub amount: i64,
    pub at: Duration,
    pub ledger: usize,
    /// `X-Ledger-Delay-Ms` of its first send (0: none).
    pub slow_ms: u64,
    /// Repeats of the first send while it runs: after how long, to which
    /// ledger.
    pub repeats: Vec<(Duration, usize)>,
}

#[derive(Debug, Clone, Copy)]
pub enum Fault {
    /// `SIGKILL` the ledger; restart it `down` later.
    Kill { ledger: usize, down: Duration },
    /// `SIGSTOP` the ledger for `stopped` (past the lease), then `SIGCONT`.
    Pause { ledger: usize, stopped: Duration },
    /// Cut every connection to the database's server.
    Cut,
    /// An outside transaction holds the account's row (or SQLite's write
    /// lock) for `hold`.
    Hold { hold: Duration },
    /// Not made, but seen: a slow transactional credit on `ledger` holds
    /// SQLite's write lock while it runs, so other requests may wait past
    /// the busy timeout: those of other processes, and with `in_process`
    /// (sqlx, one `BEGIN IMMEDIATE` writer per file) its own process's too.
    Slow { ledger: usize, in_process: bool },
}

impl Fault {
    /// How long after its start the fault is healed.
    pub fn length(self) -> Duration {
        match self {
            Fault::Kill { down, .. } => down,
            Fault::Pause { stopped, .. } => stopped,
            Fault::Cut => Duration::ZERO,
            Fault::Hold { hold } => hold,
            Fault::Slow { .. } => Duration::ZERO,
        }
    }
}

pub struct Plan {
    pub keys: Vec<KeyPlan>,
    pub faults: Vec<(Duration, Fault)>,
    /// `--wait-in-flight-ms` of both ledgers.
    pub wait_in_flight_ms: u64,
    /// From here on nothing is faulted: a 503 is a defect.
    pub quiet_from: Duration,
}

pub fn plan(seed: u64, tag: &str, cuts: bool) -> Plan {
    let mut rng = StdRng::seed_from_u64(seed);
    let ms = |rng: &mut StdRng, lo: u64, hi: u64| Duration::from_millis(rng.random_range(lo..hi));
    let slow = |rng: &mut StdRng| rng.random_range(2600..3400);
    // First, issue 36, item 5's scenario: a slow credit on one ledger, that
    // ledger stopped 0.5 s in (before its first renewal) for 3.5 s, and the
    // credit's repeat sent to the other ledger 3 s in, past the unrenewed
    // lease: it takes the key over, and the stopped holder, resumed, must
    // not write.
    let stopped = rng.random_range(0..2);
    let mut faults = vec![(
        TARGETED_PAUSE.0,
        Fault::Pause {
            ledger: stopped,
            stopped: TARGETED_PAUSE.1,
        },
    )];
    let after_targeted = TARGETED_PAUSE.0 + TARGETED_PAUSE.1;
    for _ in 0..rng.random_range(2..=4) {
        let at = after_targeted + ms(&mut rng, 300, FAULTS_WITHIN.as_millis() as u64);
        let ledger = rng.random_range(0..2);
        let fault = match rng.random_range(0..4) {
            0 => Fault::Kill {
                ledger,
                down: ms(&mut rng, 100, 1500),
            },
            1 => Fault::Pause {
                ledger,
                stopped: ms(&mut rng, 2500, 4000),
            },
            2 if cuts => Fault::Cut,
            _ => Fault::Hold {
                hold: ms(&mut rng, 300, 1500),
            },
        };
        faults.push((at, fault));
    }
    // One after the other: a fault starts once the one before is healed.
    faults.sort_by_key(|(at, _)| *at);
    let mut free = Duration::ZERO;
    for (at, fault) in &mut faults {
        *at = (*at).max(free);
        free = *at + fault.length() + Duration::from_millis(200);
    }
    let healed = faults
        .iter()
        .map(|(at, f)| *at + f.length())
        .max()
        .unwrap_or_default();
    let quiet_from = healed + GRACE;

    let mut keys = vec![KeyPlan {
        key: format!("{tag}-1"),
        amount: 1,
        at: TARGETED_PAUSE.0 - Duration::from_millis(500),
        ledger: stopped,
        slow_ms: 3000,
        repeats: vec![(Duration::from_secs(3), 1 - stopped)],
    }];
    let mut key = |at, ledger, slow_ms, repeats| {
        let n = keys.len() + 1;
        keys.push(KeyPlan {
            key: format!("{tag}-{n}"),
            amount: n as i64,
            at,
            ledger,
            slow_ms,
            repeats,
        });
    };
    for _ in 0..FAULT_PHASE_KEYS {
        let at = ms(
            &mut rng,
            0,
            (after_targeted + FAULTS_WITHIN).as_millis() as u64,
        );
        let ledger = rng.random_range(0..2);
        if rng.random_bool(0.3) {
            let slow_ms = slow(&mut rng);
            let repeat = (LEASE + ms(&mut rng, 200, 500), rng.random_range(0..2));
            key(at, ledger, slow_ms, vec![repeat]);
        } else {
            key(at, ledger, 0, vec![]);
        }
    }
    // The quiet phase: three slow credits on one ledger, each repeated
    // twice past the lease while it runs (a third of a lease apart, as
    // renewals are), on its own ledger (the writer batch of issue 36,
    // item 1) and, for the second credit, once on the other; and two
    // plain credits.
    let ledger = rng.random_range(0..2);
    for (offset, to) in [(0, ledger), (300, 1 - ledger), (600, ledger)] {
        let slow_ms = rng.random_range(3600..4000);
        let first = LEASE + ms(&mut rng, 200, 500);
        let repeats = vec![
            (first, ledger),
            (first + LEASE / 3 + ms(&mut rng, 0, 200), to),
        ];
        key(
            quiet_from + Duration::from_millis(offset),
            ledger,
            slow_ms,
            repeats,
        );
    }
    for offset in [900, 1200] {
        key(
            quiet_from + Duration::from_millis(offset),
            rng.random_range(0..2),
            0,
            vec![],
        );
    }
    let wait_in_flight_ms = if rng.random_bool(0.5) { 0 } else { 300 };
    Plan {
        keys,
        faults,
        wait_in_flight_ms,
        quiet_from,
    }
}
