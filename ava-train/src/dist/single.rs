//! One process: every collective is the identity.

use super::base::{Collectives, DistError, check_counts};

/// The group of one rank (`ava train` without `mpirun`).
#[derive(Debug, Default, Clone, Copy)]
pub struct Single;

impl Collectives for Single {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn describe(&self) -> String {
        "one process".into()
    }
    fn all_reduce_sum(&self, _: &mut [f32]) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_sum_f64(&self, _: &mut [f64]) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_max(&self, _: &mut [u64]) -> Result<(), DistError> {
        Ok(())
    }
    fn reduce_scatter_sum(&self, buf: &mut [f32], counts: &[usize]) -> Result<(), DistError> {
        check_counts("reduce-scatter", counts, 1, buf.len())
    }
    fn all_gather(&self, buf: &mut [u8], counts: &[usize]) -> Result<(), DistError> {
        check_counts("all-gather", counts, 1, buf.len())
    }
    fn broadcast(&self, _: &mut [u8], _root: usize) -> Result<(), DistError> {
        Ok(())
    }
    fn barrier(&self) -> Result<(), DistError> {
        Ok(())
    }
}
