//! [`Permutation`]: a seeded bijection of `0..n` computed per index, so a shuffled epoch of
//! any length costs no memory and any position of it is found directly (resume needs no
//! replay). A four-round Feistel network over the smallest even number of bits that covers
//! `n`, with cycle walking: an output at or past `n` is permuted again until it lands
//! inside (fewer than 4 rounds of the network on average, since the domain is under 4n).

use crate::rng::hash64;

/// A bijection of `0..n` chosen by a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Permutation {
    n: u64,
    half_bits: u32,
    key: u64,
}

impl Permutation {
    /// The permutation of `0..n` for `key`.
    pub fn new(n: u64, key: u64) -> Self {
        let bits = if n <= 1 { 2 } else { 64 - (n - 1).leading_zeros() };
        Self { n, half_bits: bits.div_ceil(2).max(1), key }
    }

    /// The image of `i` (`i < n`).
    pub fn apply(&self, i: u64) -> u64 {
        assert!(i < self.n, "index {i} outside a permutation of {}", self.n);
        let mut x = i;
        loop {
            x = self.network(x);
            if x < self.n {
                return x;
            }
        }
    }

    fn network(&self, x: u64) -> u64 {
        let mask = (1u64 << self.half_bits) - 1;
        let (mut left, mut right) = (x >> self.half_bits, x & mask);
        for round in 0..4u64 {
            let f = hash64(self.key ^ round.wrapping_mul(0x9e37_79b9_7f4a_7c15), right) & mask;
            (left, right) = (right, left ^ f);
        }
        (left << self.half_bits) | right
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn is_a_bijection_for_every_small_length() {
        for n in 1..300u64 {
            let p = Permutation::new(n, 42 + n);
            let mut seen = vec![false; n as usize];
            for i in 0..n {
                let j = p.apply(i);
                assert!(j < n && !seen[j as usize], "n = {n}: {i} → {j} twice or out of range");
                seen[j as usize] = true;
            }
        }
    }

    #[test]
    fn keys_give_different_orders_and_large_domains_work() {
        let (a, b) = (Permutation::new(1000, 1), Permutation::new(1000, 2));
        let same = (0..1000).filter(|&i| a.apply(i) == b.apply(i)).count();
        assert!(same < 20, "{same} fixed agreements between two keys");
        // Not the identity, and no long runs of consecutive outputs.
        let moved = (0..1000).filter(|&i| a.apply(i) != i).count();
        assert!(moved > 980);
        let n = (1u64 << 40) + 12345;
        let p = Permutation::new(n, 7);
        for i in [0, 1, n / 2, n - 1] {
            assert!(p.apply(i) < n);
        }
    }
}
