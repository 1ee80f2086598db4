//! The protocol's model, checked exhaustively in each mode: separate,
//! transactional in two phases, transactional in one (`cargo test -p proof
//! --release`). `PROOF_BOUND=large` checks larger bounds;
//! `PROOF_MUTATION=NAME` plants one bug (`proof/mutations.sh` runs each and
//! expects this test to fail with a counterexample).

use std::time::Instant;

use proof::{Bounds, Mode, Mutation, Protocol, State};
use stateright::{Checker, Expectation, HasDiscoveries, Model};

/// The two checks' bounds: the outbox's (small) first, then the protocol's
/// (in one phase, its own: one key shared with a claim that commits first).
fn bounds(mode: Mode) -> [(&'static str, Bounds); 2] {
    let one_phase = mode == Mode::TransactionalOnePhase;
    let mut checks = match std::env::var("PROOF_BOUND").as_deref() {
        Ok("large") if one_phase => [
            ("outbox", Bounds::LARGE_OUTBOX),
            ("protocol", Bounds::LARGE_ONE_PHASE),
        ],
        Ok("large") => [
            ("outbox", Bounds::LARGE_OUTBOX),
            ("protocol", Bounds::LARGE),
        ],
        Ok("ci") | Ok("") | Err(_) if one_phase => [
            ("outbox", Bounds::CI_OUTBOX),
            ("protocol", Bounds::CI_ONE_PHASE),
        ],
        Ok("ci") | Ok("") | Err(_) => [("outbox", Bounds::CI_OUTBOX), ("protocol", Bounds::CI)],
        Ok(other) => panic!("PROOF_BOUND={other}: expected `ci` or `large`"),
    };
    // One bound at a time, for both checks, e.g. PROOF_TICKS=5.
    for (_, bounds) in &mut checks {
        let set = |name: &str, field: &mut u8| {
            if let Ok(value) = std::env::var(name) {
                *field = value.parse().unwrap_or_else(|_| panic!("{name}={value}"));
            }
        };
        set("PROOF_ATTEMPTS", &mut bounds.attempts);
        set("PROOF_CRASHES", &mut bounds.crashes);
        set("PROOF_TICKS", &mut bounds.ticks);
    }
    checks
}

fn mutation() -> Mutation {
    let name = std::env::var("PROOF_MUTATION").unwrap_or_default();
    Mutation::parse(&name).unwrap_or_else(|| {
        let names: Vec<_> = Mutation::ALL.iter().map(|(n, _)| *n).collect();
        panic!("PROOF_MUTATION={name}: expected none or one of {names:?}")
    })
}

fn threads() -> usize {
    std::env::var("PROOF_THREADS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// A trace: each action with the real and the store's time before it, then
/// the last state.
fn trace(path: stateright::Path<State, proof::Action>) -> String {
    let mut out = String::new();
    let steps = path.into_vec();
    for (state, action) in &steps {
        if let Some(action) = action {
            out.push_str(&format!(
                "  t={} now={}  {action:?}\n",
                state.ticks, state.now
            ));
        }
    }
    if let Some((last, _)) = steps.last() {
        out.push_str(&format!(
            "  last state: t={} now={} clients={:?}\n    servers={:?}\n    records={:?}\n    open={:?}\n    rows={:?}\n    relays={:?}\n    ghost={:?}\n",
            last.ticks,
            last.now,
            last.clients,
            last.servers,
            last.records,
            last.open,
            last.rows,
            last.relays,
            last.ghost
        ));
    }
    out
}

/// Checks one mode under both bounds; returns the names of the failed
/// properties, and of the `sometimes` properties neither check reached.
fn check(mode: Mode) -> Vec<&'static str> {
    let mut failed = Vec::new();
    let mut reached = Vec::new();
    let mut names = Vec::new();
    // A bug planted only in another mode leaves this one's model unmutated,
    // checked already.
    if !mutation().planted_in(mode) {
        println!(
            "proof: {mode:?} mode, mutation {:?}: planted in another mode only, not checked",
            mutation()
        );
        return failed;
    }
    for (label, bounds) in bounds(mode) {
        // A planted bug needs one counterexample: stop at the first check
        // that finds it.
        if mutation() != Mutation::None && !failed.is_empty() {
            break;
        }
        let model = Protocol {
            mode,
            mutation: mutation(),
            bounds,
        };
        let properties = model.properties();
        let start = Instant::now();
        let mut builder = model
            .checker()
            .threads(threads())
            .finish_when(HasDiscoveries::AnyFailures);
        // PROOF_STATES=N stops after about N states (a partial check, said so).
        let target: Option<usize> = std::env::var("PROOF_STATES")
            .ok()
            .map(|n| n.parse().expect("PROOF_STATES: a number"));
        if let Some(n) = target {
            builder = builder.target_state_count(n);
            println!("proof: PROOF_STATES={n}: a partial check");
        }
        let checker = builder.spawn_bfs().join();
        let elapsed = start.elapsed();
        println!(
            "proof: {model}, {label} check {bounds:?}: {} states ({} unique), max depth {}, {:.1} s",
            checker.state_count(),
            checker.unique_state_count(),
            checker.max_depth(),
            elapsed.as_secs_f64()
        );
        for property in &properties {
            let found = checker.discovery(property.name);
            match (&property.expectation, found) {
                (Expectation::Always | Expectation::Eventually, Some(path)) => {
                    println!(
                        "counterexample for \"{}\" ({mode:?} mode, {label} check, mutation {:?}):\n{}",
                        property.name,
                        model.mutation,
                        trace(path)
                    );
                    failed.push(property.name);
                }
                (Expectation::Sometimes, Some(path)) => {
                    reached.push(property.name);
                    // The documented window is shown, as the model's evidence.
                    if property.name.starts_with("separate mode can double") && label == "protocol"
                    {
                        println!(
                            "expected: \"{}\" (README, \"Choosing a mode\"):\n{}",
                            property.name,
                            trace(path)
                        );
                    }
                }
                (Expectation::Sometimes, None) => names.push(property.name),
                _ => {}
            }
        }
    }
    if mutation() == Mutation::None {
        for name in names {
            if !reached.contains(&name) {
                println!("never reached: \"{name}\"");
                failed.push(name);
            }
        }
    }
    failed
}

#[test]
fn separate_mode() {
    let failed = check(Mode::Separate);
    assert!(failed.is_empty(), "separate mode: {failed:?}");
}

#[test]
fn transactional_mode() {
    let failed = check(Mode::Transactional);
    assert!(failed.is_empty(), "transactional mode: {failed:?}");
}

#[test]
fn transactional_one_phase_mode() {
    let failed = check(Mode::TransactionalOnePhase);
    assert!(
        failed.is_empty(),
        "transactional one-phase mode: {failed:?}"
    );
}
