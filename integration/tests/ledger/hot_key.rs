//! One hot key must not starve other keys (SQLite, transactional mode, the
//! ledger's 32 open transactions per batch): 100 repeats of a credit whose
//! handler takes 6 s (longer than the 5 s busy timeout), then a credit with
//! another key on another account. The repeats wait for the first without
//! taking places in the writer's batch, so the unrelated credit is admitted
//! and applied (it used to get 503 once 31 repeats filled the batch), and
//! the repeats, once their wait ends, get 409 (they used to get 503). It
//! still shares the batch's one commit with the slow credit: SQLite has one
//! writer, so its answer comes when that commit does. `bench/hotkey`
//! measures the latencies on every store.

use crate::driver;

use driver::{Ledger, hot_key};

#[test]
fn repeats_of_a_slow_key_leave_room_for_other_keys() {
    let dir = tempfile::tempdir().unwrap();
    let ledger = Ledger::start(
        &driver::ledger_beside_tests(),
        &dir.path().join("ledger.sqlite3"),
        "transactional",
        60,
    );
    let seen = hot_key(&ledger, 6000, 100);
    assert_eq!(seen.unrelated_status, 201, "{seen:?}");
    // Each account credited once: no repeat ran again.
    assert_eq!(seen.balances, (5, 5), "{seen:?}");
    // Each repeat waited for the slow credit up to its busy timeout (5 s,
    // less than the 6 s it runs), then was told it is still in flight: 409,
    // not 503 ("the store is busy"); none ran again.
    assert_eq!(seen.repeats.get(&(409, false)), Some(&100), "{seen:?}");
}
