//! The max hold time of a transaction in transactional mode: who ends it, the
//! layer (commit or rollback) or the store's timer, is decided once, by
//! [`Fate`].

use std::sync::atomic::{AtomicU8, Ordering::SeqCst};
use std::time::Duration;

const OPEN: u8 = 0;
/// The layer is committing or rolling back.
const ENDING: u8 = 1;
/// The max hold time passed first: whoever holds the transaction rolls back.
const EXPIRED: u8 = 2;

/// One transaction's race between the layer and the max-hold timer. The
/// first of [`Fate::end`] and [`Fate::expire`] wins; the loser sees it.
pub struct Fate {
    state: AtomicU8,
    /// The max hold time.
    pub hold: Duration,
}

impl Fate {
    /// An open transaction held at most `hold`.
    pub fn new(hold: Duration) -> Fate {
        Fate {
            state: AtomicU8::new(OPEN),
            hold,
        }
    }

    /// The layer ends the transaction; `false` when the max hold time
    /// passed first.
    pub fn end(&self) -> bool {
        match self.state.compare_exchange(OPEN, ENDING, SeqCst, SeqCst) {
            Ok(_) => true,
            Err(state) => state == ENDING,
        }
    }

    /// The timer ends it; `false` when the layer got there first.
    pub fn expire(&self) -> bool {
        self.state
            .compare_exchange(OPEN, EXPIRED, SeqCst, SeqCst)
            .is_ok()
    }

    /// Whether the timer won.
    pub fn expired(&self) -> bool {
        self.state.load(SeqCst) == EXPIRED
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_to_end_wins_and_the_other_sees_it() {
        let layer_first = Fate::new(Duration::from_secs(1));
        assert!(layer_first.end());
        assert!(layer_first.end(), "ending twice is still the layer's");
        assert!(!layer_first.expire());
        assert!(!layer_first.expired());

        let timer_first = Fate::new(Duration::from_secs(1));
        assert!(timer_first.expire());
        assert!(!timer_first.end());
        assert!(!timer_first.expire(), "the timer expires it once");
        assert!(timer_first.expired());
    }
}
