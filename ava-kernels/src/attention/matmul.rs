//! Small matrix products for the attention kernels. Always single-threaded: the kernels
//! already run one task per thread, and a fixed order keeps results reproducible.
//!
//! Tile-sized products whose right operand has contiguous rows (k <= 256, m a multiple of
//! 4, n of 16) run a register-blocked 4 × 16 FMA kernel on AVX2 CPUs: at these sizes it
//! reaches ~90 GFLOP/s per core where `gemm` (the crate candle uses), which packs both
//! operands on every call, reaches 70–85. On AVX-512 CPUs the columns go 32 at a time
//! (8 or 4 rows × 32 columns in 16 or 8 zmm registers), the 4 × 16 kernel taking a last 16.
//! Every element is the same chain of fused multiply-adds over k in both kernels, so the
//! results are the same bits whichever runs. Everything else goes through `gemm`.

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
        && m.is_multiple_of(4)
        && n.is_multiple_of(16)
        && k <= 256
        && crate::rows::has_avx2()
    {
        // SAFETY: the CPU has AVX2 and FMA; the asserts above keep every element read or
        // written inside the slices (non-negative strides, so the extremes are the corners).
        unsafe {
            if crate::rows::has_avx512() {
                // The CPU also has AVX-512F.
                micro::matmul512(m, n, k, dst, dst_rs, lhs, rhs, beta, accumulate);
            } else {
                micro::matmul(m, n, k, dst, dst_rs, lhs, rhs, beta, accumulate);
            }
        }
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

    /// `C (R × 32) = beta · A (R × k) · B (k × 32)`, added to C when `accumulate`: R × 2 zmm
    /// accumulators; per step two loads of B, R broadcasts of A and 2R FMAs. Each element is
    /// [`block`]'s chain (fma over p, then `beta · x` or `y + beta · x`, rounded apart).
    ///
    /// # Safety
    /// AVX-512F; as [`block`] with 32 columns.
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block512<const R: usize>(
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
        use std::arch::x86_64::*;
        // SAFETY (whole body): AVX-512F by the caller's contract; every pointer in bounds by it.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); 2]; R];
            for p in 0..k {
                let b0 = _mm512_loadu_ps(b.add(p * brs));
                let b1 = _mm512_loadu_ps(b.add(p * brs + 16));
                for (r, row) in acc.iter_mut().enumerate() {
                    let av = _mm512_set1_ps(*a.add(r * ars + p * acs));
                    row[0] = _mm512_fmadd_ps(av, b0, row[0]);
                    row[1] = _mm512_fmadd_ps(av, b1, row[1]);
                }
            }
            let beta = _mm512_set1_ps(beta);
            for (r, row) in acc.iter().enumerate() {
                for (v, &x) in row.iter().enumerate() {
                    let y = c.add(r * crs + 16 * v);
                    let scaled = _mm512_mul_ps(beta, x);
                    let out = if accumulate { _mm512_add_ps(_mm512_loadu_ps(y), scaled) } else { scaled };
                    _mm512_storeu_ps(y, out);
                }
            }
        }
    }

    /// [`matmul`] on AVX-512F: columns 32 at a time in blocks of 8 rows (4 when m is no
    /// multiple of 8), a last 16 columns by [`block`].
    ///
    /// # Safety
    /// The CPU supports AVX-512F, AVX2 and FMA, and every element of the product lies inside
    /// the slices (checked by the caller).
    #[target_feature(enable = "avx512f,avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn matmul512(
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
        let rows = if m.is_multiple_of(8) { 8 } else { 4 };
        for i in (0..m).step_by(rows) {
            for j in (0..n).step_by(32) {
                let a = lhs.data.as_ptr().wrapping_add(i * ars);
                let b = rhs.data.as_ptr().wrapping_add(j);
                let c = dst.as_mut_ptr().wrapping_add(i * dst_rs + j);
                // SAFETY: rows i..i+rows and columns j..j+32 (or the last 16) are inside the
                // checked extents; AVX-512F, AVX2 and FMA by the caller's contract.
                unsafe {
                    match (n - j >= 32, rows) {
                        (true, 8) => block512::<8>(k, a, (ars, acs), b, brs, c, dst_rs, beta, accumulate),
                        (true, _) => block512::<4>(k, a, (ars, acs), b, brs, c, dst_rs, beta, accumulate),
                        (false, _) => {
                            for r in (0..rows).step_by(4) {
                                let (a, c) = (a.wrapping_add(r * ars), c.wrapping_add(r * dst_rs));
                                block(k, a, (ars, acs), b, brs, c, dst_rs, beta, accumulate);
                            }
                        }
                    }
                }
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

    /// The AVX-512 kernel gives the AVX2 kernel's bits: the same chain per element, in 8- and
    /// 4-row blocks, with and without a last 16 columns, transposed or not, accumulating or not.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_avx512_tiles_give_the_avx2_tiles_bits() {
        if !crate::rows::has_avx512() {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let mut rng = Rng(7);
        for (m, n, k) in [(8, 32, 64), (4, 48, 17), (24, 80, 256), (12, 16, 5), (16, 64, 1)] {
            let (a, b, c0) = (rng.vec(m * k), rng.vec(k * n), rng.vec(m * n));
            for transposed in [false, true] {
                let lhs = if transposed { Mat::transposed(&a, m) } else { Mat::rows(&a, k) };
                for accumulate in [false, true] {
                    let (mut wide, mut narrow) = (c0.clone(), c0.clone());
                    // SAFETY: this CPU has AVX-512F, AVX2 and FMA (checked); every operand
                    // covers its shape.
                    unsafe {
                        micro::matmul512(m, n, k, &mut wide, n, lhs, Mat::rows(&b, n), 0.3, accumulate);
                        micro::matmul(m, n, k, &mut narrow, n, lhs, Mat::rows(&b, n), 0.3, accumulate);
                    }
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&wide), bits(&narrow), "{m}x{n}x{k} t={transposed} acc={accumulate}");
                }
            }
        }
    }

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
