//! Small matrix products for the attention kernels. Always single-threaded: the kernels
//! already run one task per thread, and a fixed order keeps results reproducible.
//!
//! Tile-sized products whose right operand has contiguous rows (k <= 256, m a multiple of
//! 4, n of 16) run a register-blocked 4 × 16 FMA kernel on AVX2 CPUs: at these sizes it
//! reaches ~90 GFLOP/s per core where `gemm` (the crate candle uses), which packs both
//! operands on every call, reaches 70–85. Everything else goes through `gemm`.

/// A read-only strided matrix view: element (i, j) is `data[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub struct Mat<'a> {
    /// The elements (the view reads inside it only; checked before each product).
    pub data: &'a [f32],
    /// Row stride.
    pub rs: isize,
    /// Column stride.
    pub cs: isize,
}

impl<'a> Mat<'a> {
    /// A row-major `rows × cols` view of `data` with row stride `rs`.
    pub fn rows(data: &'a [f32], rs: usize) -> Self {
        Self { data, rs: rs as isize, cs: 1 }
    }

    /// The transpose of a row-major matrix with row stride `rs`: element (i, j) is
    /// `data[j·rs + i]`.
    pub fn transposed(data: &'a [f32], rs: usize) -> Self {
        Self { data, rs: 1, cs: rs as isize }
    }

    /// Whether every element of a `rows × cols` matrix lies inside `data`.
    fn fits(&self, rows: usize, cols: usize) -> bool {
        rows == 0
            || cols == 0
            || ((rows - 1) as isize * self.rs + (cols - 1) as isize * self.cs) < self.data.len() as isize
    }
}

/// `dst (m × n, row stride dst_rs) = beta · lhs (m × k) · rhs (k × n)`, added to `dst` when
/// `accumulate`.
#[allow(clippy::too_many_arguments)] // the BLAS signature: sizes, destination, operands, scaling
pub fn matmul(
    m: usize,
    n: usize,
    k: usize,
    dst: &mut [f32],
    dst_rs: usize,
    lhs: Mat<'_>,
    rhs: Mat<'_>,
    beta: f32,
    accumulate: bool,
) {
    if m == 0 || n == 0 {
        return;
    }
    assert!(lhs.fits(m, k) && rhs.fits(k, n), "attention matmul operand out of bounds");
    assert!((m - 1) * dst_rs + n <= dst.len(), "attention matmul destination out of bounds");
    if k == 0 {
        if !accumulate {
            for row in dst.chunks_mut(dst_rs).take(m) {
                row[..n].fill(0.0);
            }
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if rhs.cs == 1
        && lhs.rs >= 0
        && lhs.cs >= 0
        && rhs.rs >= 0
        && m % 4 == 0
        && n % 16 == 0
        && k <= 256
        && crate::rows::has_avx2()
    {
        // SAFETY: the CPU has AVX2 and FMA; the asserts above keep every element read or
        // written inside the slices (non-negative strides, so the extremes are the corners).
        unsafe { micro::matmul(m, n, k, dst, dst_rs, lhs, rhs, beta, accumulate) };
        return;
    }
    // SAFETY: the asserts above keep every element gemm reads or writes inside the slices;
    // `dst` is exclusively borrowed and does not overlap the shared `lhs`/`rhs`.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst.as_mut_ptr(),
            1,
            dst_rs as isize,
            accumulate,
            lhs.data.as_ptr(),
            lhs.cs,
            lhs.rs,
            rhs.data.as_ptr(),
            rhs.cs,
            rhs.rs,
            1.0,
            beta,
            false,
            false,
            false,
            gemm::Parallelism::None,
        )
    };
}

/// The 4 × 16 register-blocked kernel (x86-64 with AVX2 + FMA).
#[cfg(target_arch = "x86_64")]
mod micro {
    use super::Mat;

    /// `C (4 × 16) = beta · A (4 × k) · B (k × 16)`, added to C when `accumulate`. The 64
    /// accumulators are 8 ymm registers; per step, two loads of B, four broadcasts of A and
    /// eight FMAs.
    ///
    /// # Safety
    /// `a`, `b`, `c` point at the block's first elements; A(r, p) = `a[r·ars + p·acs]`,
    /// B(p, 0..16) = `b[p·brs..][..16]`, C(r, 0..16) = `c[r·crs..][..16]`, all in bounds.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block(
        k: usize,
        a: *const f32,
        (ars, acs): (usize, usize),
        b: *const f32,
        brs: usize,
        c: *mut f32,
        crs: usize,
        beta: f32,
        accumulate: bool,
    ) {
        let mut acc = [[0f32; 16]; 4];
        for p in 0..k {
            // SAFETY: in bounds by the caller's contract.
            let brow = unsafe { &*(b.add(p * brs) as *const [f32; 16]) };
            for (r, acc) in acc.iter_mut().enumerate() {
                // SAFETY: in bounds by the caller's contract.
                let av = unsafe { *a.add(r * ars + p * acs) };
                for (x, &bv) in acc.iter_mut().zip(brow) {
                    *x = av.mul_add(bv, *x);
                }
            }
        }
        for (r, acc) in acc.iter().enumerate() {
            // SAFETY: in bounds by the caller's contract.
            let crow = unsafe { &mut *(c.add(r * crs) as *mut [f32; 16]) };
            for (y, &x) in crow.iter_mut().zip(acc) {
                *y = if accumulate { *y + beta * x } else { beta * x };
            }
        }
    }

    /// See [`super::matmul`]; m % 4 == 0, n % 16 == 0, B rows contiguous.
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA, and every element of the product lies inside the slices
    /// (checked by the caller).
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn matmul(
        m: usize,
        n: usize,
        k: usize,
        dst: &mut [f32],
        dst_rs: usize,
        lhs: Mat<'_>,
        rhs: Mat<'_>,
        beta: f32,
        accumulate: bool,
    ) {
        let (ars, acs, brs) = (lhs.rs as usize, lhs.cs as usize, rhs.rs as usize);
        for i in (0..m).step_by(4) {
            for j in (0..n).step_by(16) {
                // SAFETY: rows i..i+4 and columns j..j+16 are inside the checked extents.
                unsafe {
                    block(
                        k,
                        lhs.data.as_ptr().add(i * ars),
                        (ars, acs),
                        rhs.data.as_ptr().add(j),
                        brs,
                        dst.as_mut_ptr().add(i * dst_rs + j),
                        dst_rs,
                        beta,
                        accumulate,
                    )
                };
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::Rng;

    /// Both paths (the 4 × 16 kernel for eligible shapes, gemm for the rest) against a plain
    /// f64 triple loop, with plain and transposed left operands, overwriting and accumulating.
    #[test]
    fn products_match_a_plain_loop() {
        let mut rng = Rng(1);
        for (m, n, k) in [(4, 16, 1), (64, 64, 64), (8, 32, 256), (12, 48, 7), (5, 16, 9), (4, 17, 3), (64, 64, 300)] {
            let a = rng.vec(m * k);
            let b = rng.vec(k * n);
            let c0 = rng.vec(m * n);
            for transposed in [false, true] {
                for accumulate in [false, true] {
                    // A(i, p): row-major (m × k), or the transpose of a (k × m) matrix.
                    let (lhs, at): (Mat<'_>, Box<dyn Fn(usize, usize) -> f32>) = if transposed {
                        (Mat::transposed(&a, m), Box::new(|i, p| a[p * m + i]))
                    } else {
                        (Mat::rows(&a, k), Box::new(|i, p| a[i * k + p]))
                    };
                    let mut c = c0.clone();
                    matmul(m, n, k, &mut c, n, lhs, Mat::rows(&b, n), 0.5, accumulate);
                    for i in 0..m {
                        for j in 0..n {
                            let dot: f64 = (0..k).map(|p| at(i, p) as f64 * b[p * n + j] as f64).sum();
                            let want = 0.5 * dot + if accumulate { c0[i * n + j] as f64 } else { 0.0 };
                            let got = c[i * n + j] as f64;
                            assert!(
                                (got - want).abs() < 1e-5 * (1.0 + k as f64),
                                "{m}x{n}x{k} t={transposed} acc={accumulate} ({i}, {j}): {got} vs {want}"
                            );
                        }
                    }
                }
            }
        }
    }
}
