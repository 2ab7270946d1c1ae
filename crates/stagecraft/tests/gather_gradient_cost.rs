//! The gradient of a gather is an index-add: O(indices × row) work and no
//! intermediate bigger than the gradient itself. It used to be a one-hot
//! matrix of `[indices, rows]` multiplied by the incoming gradient,
//! O(indices × rows × row); these tests fail if that path comes back.
//! Their own test binary: profiling is process-wide.

mod common;

use common::kernels_run;
use stagecraft::{function, grad, Device, Tensor};

/// An embedding-style lookup: 3 rows (one twice) of a `[rows, 8]` table.
fn lookup(table: &Tensor<f32>) -> Tensor<f32> {
    let ids = Tensor::<i64>::from_vec(vec![5, -1, 5], &[3], &table.device()).unwrap();
    let picked = table.index_select(0, &ids);
    (&picked * &picked).sum(&[], false)
}

/// `2 x` on the picked rows (row 5 twice, the last row once), zero
/// elsewhere.
fn check_gradient(g: &Tensor<f32>, table: &[f32], rows: usize) {
    let got = g.to_vec().unwrap();
    for r in 0..rows {
        let times = match r {
            5 => 2.0,
            r if r == rows - 1 => 1.0,
            _ => 0.0,
        };
        for c in 0..8 {
            let want = 2.0 * times * table[r * 8 + c];
            assert_eq!(got[r * 8 + c], want, "row {r} column {c}");
        }
    }
}

#[test]
fn the_gather_gradient_is_an_index_add_in_every_mode() {
    let cpu = Device::cpu();
    let rows = 64;
    let values: Vec<f32> = (0..rows * 8).map(|i| (i % 17) as f32 * 0.125).collect();
    let staged = function(|t: Tensor<f32>| lookup(&t));
    for device in [cpu, Device::lazy(&cpu)] {
        let table = Tensor::from_vec(values.clone(), &[rows, 8], &device).unwrap();
        let mut g = None;
        let ran = kernels_run(|| {
            let dg = grad(lookup)(&table);
            dg.to_vec().unwrap();
            g = Some(dg);
        });
        assert!(ran.iter().any(|k| k == "IndexAdd"), "{ran:?}");
        assert!(
            !ran.iter().any(|k| k == "OneHot" || k == "MatMul"),
            "{ran:?}"
        );
        check_gradient(&g.unwrap(), &values, rows);
    }
    // Through `function`: the gradient graph is built by the IR autodiff.
    let table = Tensor::from_vec(values.clone(), &[rows, 8], &cpu).unwrap();
    let mut g = None;
    let ran = kernels_run(|| {
        let dg = grad(|t: &Tensor<f32>| staged.call(t.clone()))(&table);
        dg.to_vec().unwrap();
        g = Some(dg);
    });
    assert!(ran.iter().any(|k| k == "IndexAdd"), "{ran:?}");
    assert!(
        !ran.iter().any(|k| k == "OneHot" || k == "MatMul"),
        "{ran:?}"
    );
    check_gradient(&g.unwrap(), &values, rows);
}

/// A table of 1M rows: the one-hot path would build a `[3, 1M]` matrix
/// and multiply the gradient through all of it; the index-add zeroes the
/// gradient once and adds three rows into it.
#[test]
fn a_large_table_gradient_touches_only_the_picked_rows() {
    let cpu = Device::cpu();
    let rows = 1 << 20;
    let table = Tensor::<f32>::full(&[rows, 8], 0.5, &cpu);
    let mut g = None;
    let ran = kernels_run(|| g = Some(grad(lookup)(&table)));
    assert!(
        !ran.iter().any(|k| k == "OneHot" || k == "MatMul"),
        "{ran:?}"
    );
    let g = g.unwrap();
    // Row 4 (not picked), row 5 (picked twice) and the last row (once).
    let picked = g.index_select(
        0,
        &Tensor::<i64>::from_vec(vec![4, 5, -1], &[3], &cpu).unwrap(),
    );
    assert_eq!(
        picked.sum(&[1], false).to_vec().unwrap(),
        vec![0.0, 2.0 * 2.0 * 0.5 * 8.0, 2.0 * 0.5 * 8.0]
    );
}
