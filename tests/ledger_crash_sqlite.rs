//! Crash-proof: real ledger processes in transactional mode, SIGKILLed at
//! random moments while handlers sit between their credit and their answer.
//! Every key is retried until it completes; each must be credited exactly once.

#[path = "common/ledger_driver.rs"]
mod driver;

#[test]
fn transactional_mode_credits_every_key_exactly_once_across_kills() {
    let dir = tempfile::tempdir().unwrap();
    let seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos() as u64;
    println!("seed {seed}");
    let report = driver::storm(&driver::StormConfig {
        binary: driver::ledger_beside_tests(),
        db: dir.path().join("ledger.sqlite3"),
        mode: "transactional".into(),
        bursts: 4,
        keys_per_burst: 32,
        pause_ms: 60,
        lease_secs: 2,
        seed,
    });
    println!("{report:?}");
    assert_eq!(report.kills, 4);
    assert_eq!(report.keys, 128);
    assert!(
        report.unanswered > 0,
        "no kill landed while a request was open: {report:?}"
    );
    assert_eq!(report.applied_twice, 0, "{report:?}");
    assert_eq!(report.lost, 0, "{report:?}");
    assert_eq!(report.balance, report.expected_balance, "{report:?}");
}
