//! Seeded inputs for the backend's unit tests, in one place so every kernel
//! test draws its matrices the same way.

use ndarray::Array2;
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// An `r × c` matrix uniform in [-1, 1), drawn row by row from `rng` (tests that
/// draw several inputs from one stream).
pub(crate) fn rand_rows_from(rng: &mut impl Rng, r: usize, c: usize) -> Array2<f32> {
    Array2::from_shape_fn((r, c), |_| rng.random::<f32>() * 2.0 - 1.0)
}

/// [`rand_rows_from`] a ChaCha8 stream of its own, seeded with `seed`.
pub(crate) fn rand_rows(seed: u64, r: usize, c: usize) -> Array2<f32> {
    rand_rows_from(&mut ChaCha8Rng::seed_from_u64(seed), r, c)
}

/// A rayon pool of `threads` threads, to run a product on a chosen thread count.
pub(crate) fn pool(threads: usize) -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool")
}
