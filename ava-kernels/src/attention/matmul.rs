//! Small matrix products for the attention kernels, through `gemm` (the crate candle uses),
//! which picks AVX2/AVX-512 micro-kernels at run time. Always single-threaded: the kernels
//! already run one task per thread, and a fixed order keeps results reproducible.

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
