//! Client keys cannot be predicted from earlier ones.
//!
//! Keys used to be two outputs of the fencing-token generator:
//! `splitmix64(K + n * GOLDEN)` over a per-process secret `K` and a counter
//! `n`. SplitMix64's finalizer is a bijection that can be inverted, so one
//! observed key gave `K + n * GOLDEN` and with it every later key. These
//! tests run that attack: first against a replica of the old generator (it
//! must succeed, or the attack is wrong), then against `client::new_key`
//! (it must fail).

#![cfg(feature = "client")]

use http::HeaderValue;
use tower_idempotency::client::new_key;
use tower_idempotency::store::FencingToken;

/// The increment of the old generator's counter (2^64 / golden ratio).
const GOLDEN: u64 = 0x9e37_79b9_7f4a_7c15;

fn splitmix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The inverse of an odd number modulo 2^64 (Newton's iteration: each step
/// doubles the correct low bits, from 3).
fn inverse(odd: u64) -> u64 {
    let mut x = odd;
    for _ in 0..5 {
        x = x.wrapping_mul(2u64.wrapping_sub(odd.wrapping_mul(x)));
    }
    x
}

/// The inverse of `y = x ^ (x >> shift)`.
fn unshift(y: u64, shift: u32) -> u64 {
    let mut x = y;
    for _ in 0..64 / shift {
        x = y ^ (x >> shift);
    }
    x
}

/// The inverse of `splitmix64`.
fn unmix(mut z: u64) -> u64 {
    z = unshift(z, 31);
    z = z.wrapping_mul(inverse(0x94d0_49bb_1331_11eb));
    z = unshift(z, 27);
    z = z.wrapping_mul(inverse(0xbf58_476d_1ce4_e5b9));
    unshift(z, 30)
}

/// The two 64-bit halves of a key of 32 hex digits in quotes.
fn halves(key: &HeaderValue) -> [u64; 2] {
    let text = key.to_str().unwrap();
    assert_eq!(text.len(), 34, "{text}");
    let hex = &text[1..33];
    [
        u64::from_str_radix(&hex[..16], 16).unwrap(),
        u64::from_str_radix(&hex[16..], 16).unwrap(),
    ]
}

fn key_of(halves: [u64; 2]) -> HeaderValue {
    HeaderValue::from_str(&format!("\"{:016x}{:016x}\"", halves[0], halves[1])).unwrap()
}

/// The attack: the key after `key`, if keys were successive outputs of the
/// old generator.
fn predict_next(key: &HeaderValue) -> HeaderValue {
    let state = unmix(halves(key)[1]);
    key_of([
        splitmix64(state.wrapping_add(GOLDEN)),
        splitmix64(state.wrapping_add(GOLDEN.wrapping_mul(2))),
    ])
}

/// How many counter steps of the old generator lead from `a` to `b`
/// (`unmix(b) - unmix(a) = steps * GOLDEN`), as a signed number.
fn steps(a: u64, b: u64) -> i64 {
    unmix(b)
        .wrapping_sub(unmix(a))
        .wrapping_mul(inverse(GOLDEN)) as i64
}

/// A replica of the old key generator, with a known secret.
struct OldGenerator {
    secret: u64,
    counter: u64,
}

impl OldGenerator {
    fn token(&mut self) -> u64 {
        let n = self.counter;
        self.counter += 1;
        splitmix64(self.secret.wrapping_add(n.wrapping_mul(GOLDEN)))
    }

    fn key(&mut self) -> HeaderValue {
        key_of([self.token(), self.token()])
    }
}

#[test]
fn the_attack_predicts_the_old_generator_exactly() {
    assert_eq!(inverse(GOLDEN).wrapping_mul(GOLDEN), 1);
    assert_eq!(
        unmix(splitmix64(0x0123_4567_89ab_cdef)),
        0x0123_4567_89ab_cdef
    );
    let mut old = OldGenerator {
        secret: 0x5eed_0fa1_1ce5,
        counter: 17,
    };
    let mut key = old.key();
    for _ in 0..1000 {
        let next = old.key();
        assert_eq!(predict_next(&key), next);
        let [a, b] = halves(&key);
        assert_eq!(steps(a, b), 1);
        assert_eq!(steps(b, halves(&next)[0]), 1);
        key = next;
    }
}

#[test]
fn one_key_does_not_predict_the_next() {
    let mut key = new_key().unwrap();
    let mut predicted = 0;
    for _ in 0..10_000 {
        let next = new_key().unwrap();
        predicted += usize::from(predict_next(&key) == next);
        key = next;
    }
    assert_eq!(predicted, 0);
}

/// No two halves of two successive keys, and no half of a key and the
/// fencing tokens drawn around it, are within a million counter steps of the
/// fencing-token generator (for independent random values, odds of about
/// 2^-43 per pair). With the old keys, each key half was one step after the
/// token drawn before it.
#[test]
fn keys_share_no_step_of_the_fencing_token_generator() {
    const NEAR: u64 = 1_000_000;
    let near = |a: u64, b: u64| steps(a, b).unsigned_abs() <= NEAR;
    let before = FencingToken::random().0 as u64;
    let first = halves(&new_key().unwrap());
    let between = FencingToken::random().0 as u64;
    let second = halves(&new_key().unwrap());
    let after = FencingToken::random().0 as u64;

    let key_halves = [first[0], first[1], second[0], second[1]];
    for (i, &a) in key_halves.iter().enumerate() {
        for &b in &key_halves[i + 1..] {
            assert!(!near(a, b), "{a:016x} and {b:016x}");
        }
        for token in [before, between, after] {
            assert!(!near(token, a), "token {token:016x} and key half {a:016x}");
        }
    }
}
