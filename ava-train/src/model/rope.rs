//! Rotary position embedding settings ([`RopeSpec`]) and the frequencies they give: the base θ
//! and one of the scalings Llama-family checkpoints use (Hugging Face's `rope_type`:
//! `default`, `linear`, `dynamic`, `llama3`, `yarn`).
//!
//! The formulas follow transformers' `modeling_rope_utils.py` (5.24, the same in 4.57 for
//! these types): each returns the inverse frequency of every pair of a head (`D/2` values)
//! and an attention factor that multiplies both cos and sin. They are computed in f64 here;
//! transformers computes them in f32, a difference of ~1e-7 in an angle (the golden tests in
//! `tests/hf_golden.rs` compare the logits of both).

use std::f64::consts::PI;

/// How the rotary frequencies are scaled (transformers' `rope_type`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    /// `θ^(-2i/D)`.
    Default,
    /// Position interpolation (kaiokendev): every frequency divided by `factor`.
    Linear {
        /// The divisor, ≥ 1.
        factor: f64,
    },
    /// Dynamic NTK (bloc97, emozilla): past `max_position` tokens the base grows with the
    /// sequence length. transformers re-derives it from each forward's length; here it is
    /// derived from the length the tables are built for (the run's `data.seq_len`).
    Dynamic {
        /// Scaling factor, ≥ 1.
        factor: f64,
        /// `max_position_embeddings`: below it nothing changes.
        max_position: usize,
    },
    /// Llama 3.1's wavelength-dependent scaling: long wavelengths divided by `factor`, short
    /// ones kept, those between interpolated.
    Llama3 {
        /// Divisor of the low frequencies.
        factor: f64,
        /// `original_max_position_embeddings / low_freq_factor` is the longest wavelength kept
        /// smooth.
        low_freq_factor: f64,
        /// `original_max_position_embeddings / high_freq_factor` is the shortest wavelength
        /// scaled.
        high_freq_factor: f64,
        /// The pre-training context length.
        original_max_position: usize,
    },
    /// YaRN (Peng et al. 2023): interpolation for low frequencies, extrapolation for high
    /// ones, a linear ramp between, and cos/sin scaled by an attention factor.
    Yarn {
        /// Context extension factor.
        factor: f64,
        /// The pre-training context length.
        original_max_position: usize,
        /// cos/sin multiplier; when absent, derived from `factor`, `mscale`, `mscale_all_dim`.
        attention_factor: Option<f64>,
        /// Rotations at which the ramp starts (default 32).
        beta_fast: f64,
        /// Rotations at which the ramp ends (default 1).
        beta_slow: f64,
        /// DeepSeek's mscale (0: absent).
        mscale: f64,
        /// DeepSeek's mscale_all_dim (0: absent).
        mscale_all_dim: f64,
        /// Round the ramp's ends outwards to whole dimensions (transformers' default, true).
        truncate: bool,
    },
}

/// Rotary embedding settings: the base θ and its scaling.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RopeSpec {
    /// The base θ (`rope_theta`).
    pub theta: f64,
    /// The scaling (`rope_type` and its parameters).
    pub scaling: RopeScaling,
}

impl RopeSpec {
    /// Plain RoPE with base `theta`.
    pub fn plain(theta: f64) -> Self {
        Self { theta, scaling: RopeScaling::Default }
    }

    /// The `rope_type` name transformers uses.
    pub fn type_name(&self) -> &'static str {
        match self.scaling {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// The inverse frequency of each of the `head_dim / 2` pairs of a head, and the factor
    /// both cos and sin are multiplied by, for tables covering `seq` positions.
    pub fn frequencies(&self, head_dim: usize, seq: usize) -> (Vec<f64>, f64) {
        let dim = head_dim as f64;
        let plain = |base: f64| -> Vec<f64> { (0..head_dim / 2).map(|i| base.powf(-((2 * i) as f64) / dim)).collect() };
        match self.scaling {
            RopeScaling::Default => (plain(self.theta), 1.0),
            RopeScaling::Linear { factor } => (plain(self.theta).into_iter().map(|f| f / factor).collect(), 1.0),
            RopeScaling::Dynamic { factor, max_position } => {
                let len = seq.max(max_position) as f64;
                let max = max_position as f64;
                let base = self.theta * ((factor * len / max) - (factor - 1.0)).powf(dim / (dim - 2.0));
                (plain(base), 1.0)
            }
            RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position } => {
                let old = original_max_position as f64;
                let (low_wavelen, high_wavelen) = (old / low_freq_factor, old / high_freq_factor);
                let freqs = plain(self.theta)
                    .into_iter()
                    .map(|f| {
                        let wavelen = 2.0 * PI / f;
                        if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * f / factor + smooth * f
                        }
                    })
                    .collect();
                (freqs, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position,
                attention_factor,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                truncate,
            } => {
                let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
                let attention = attention_factor.unwrap_or(if mscale != 0.0 && mscale_all_dim != 0.0 {
                    get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                } else {
                    get_mscale(factor, 1.0)
                });
                // The dimension at which a frequency turns `rotations` times over the
                // original context.
                let correction_dim = |rotations: f64| {
                    dim * (original_max_position as f64 / (rotations * 2.0 * PI)).ln() / (2.0 * self.theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    (low, high) = (low.floor(), high.ceil());
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001; // transformers' guard against a zero-width ramp
                }
                let freqs = plain(self.theta)
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| {
                        let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        (f / factor) * (1.0 - extrapolation) + f * extrapolation
                    })
                    .collect();
                (freqs, attention)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The three bands of transformers' `_compute_llama3_parameters` (the logits against
    /// transformers itself are in `tests/hf_golden.rs`).
    #[test]
    fn llama3_bands_match_transformers() {
        let rope = RopeSpec {
            theta: 500_000.0,
            scaling: RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_position: 64,
            },
        };
        let (f, a) = rope.frequencies(16, 16);
        assert_eq!(a, 1.0);
        let plain = RopeSpec::plain(500_000.0).frequencies(16, 16).0;
        // wavelength 2π (< 16): kept; ≥ 167 (> 64): divided by 8; 32 lies between.
        assert_eq!(f[0], plain[0]);
        assert!((f[2] - plain[2] / 8.0).abs() < 1e-15);
        let smooth = (64.0 / (2.0 * PI / plain[1]) - 1.0) / 3.0;
        assert!((f[1] - ((1.0 - smooth) * plain[1] / 8.0 + smooth * plain[1])).abs() < 1e-15);
    }

    #[test]
    fn dynamic_changes_nothing_inside_the_original_context() {
        let rope = RopeSpec { theta: 1e4, scaling: RopeScaling::Dynamic { factor: 4.0, max_position: 32 } };
        assert_eq!(rope.frequencies(8, 32), RopeSpec::plain(1e4).frequencies(8, 32));
        let (longer, _) = rope.frequencies(8, 64);
        // base · (4·64/32 − 3)^(8/6) = base · 5^(4/3)
        let base = 1e4 * 5f64.powf(8.0 / 6.0);
        assert!((longer[1] - base.powf(-2.0 / 8.0)).abs() < 1e-12);
    }

    #[test]
    fn yarn_attention_factor_follows_mscale() {
        let yarn = |mscale: f64, all: f64, attention_factor: Option<f64>| RopeSpec {
            theta: 1e4,
            scaling: RopeScaling::Yarn {
                factor: 4.0,
                original_max_position: 16,
                attention_factor,
                beta_fast: 32.0,
                beta_slow: 1.0,
                mscale,
                mscale_all_dim: all,
                truncate: true,
            },
        };
        assert!((yarn(0.0, 0.0, None).frequencies(16, 8).1 - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-15);
        let ratio = (0.1 * 2.0 * 4f64.ln() + 1.0) / (0.1 * 4f64.ln() + 1.0);
        assert!((yarn(2.0, 1.0, None).frequencies(16, 8).1 - ratio).abs() < 1e-15);
        assert_eq!(yarn(2.0, 1.0, Some(0.5)).frequencies(16, 8).1, 0.5);
    }
}
