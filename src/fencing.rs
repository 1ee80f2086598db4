//! [`FencingToken`]: the owner mark of an in-flight record, and its generator.

use std::fmt;

/// An in-flight record's owner mark. Complete and release succeed only with
/// the token that the record still carries.
///
/// Random 64-bit values: a record that is released and claimed again never
/// reuses a token that an old holder may still hold.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct FencingToken(pub i64);

impl FencingToken {
    /// A fresh token: unpredictable, and never repeated within the process.
    ///
    /// A 64-bit key drawn once per process from the operating system's
    /// generator, and a process-wide counter, mixed by SplitMix64's
    /// finalizer (a bijection, so distinct counters give distinct tokens).
    /// Two processes collide only if their random keys happen to line up
    /// (odds about 2^-64 per pair of tokens). One system call per process,
    /// not per request.
    pub fn random() -> Self {
        use std::sync::OnceLock;
        use std::sync::atomic::{AtomicU64, Ordering};
        static KEY: OnceLock<u64> = OnceLock::new();
        static COUNTER: AtomicU64 = AtomicU64::new(0);
        let key = *KEY.get_or_init(|| {
            let mut bytes = [0; 8];
            // getrandom fails only where the OS has no entropy source at all;
            // then the clock's nanoseconds stand in.
            if getrandom::fill(&mut bytes).is_err() {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map_or(0, |d| d.as_nanos() as u64);
                bytes = nanos.to_be_bytes();
            }
            u64::from_be_bytes(bytes)
        });
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        FencingToken(splitmix64(key.wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15))) as i64)
    }
}

/// SplitMix64's output function: a bijection on 64-bit values.
fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl fmt::Debug for FencingToken {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "FencingToken({:016x})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fencing_tokens_never_repeat_within_a_process() {
        let tokens: std::collections::HashSet<i64> =
            (0..200_000).map(|_| FencingToken::random().0).collect();
        assert_eq!(tokens.len(), 200_000);
    }

    #[test]
    fn splitmix64_is_a_bijection_on_a_sample() {
        let outputs: std::collections::HashSet<u64> = (0..100_000u64).map(splitmix64).collect();
        assert_eq!(outputs.len(), 100_000);
        assert_ne!(splitmix64(1), 1);
    }
}
