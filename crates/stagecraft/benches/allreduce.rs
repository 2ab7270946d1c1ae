//! All-reduce bandwidth: stagecraft's `AllReduce` op (eager, through
//! `execute`) and its communicator (start + wait) against a plain rsmpi
//! `all_reduce_into` loop on buffers of the same size, side by side in one
//! run on 2 processes. A fourth column, rsmpi's non-blocking
//! `immediate_all_reduce_into` + `wait`, is the floor for collectives
//! that must not block the caller (stagecraft's are non-blocking, so a
//! watchdog can stop a hung one).
//!
//! `cargo bench -p stagecraft --features mpi --bench allreduce` launches
//! itself under `mpirun -np 2`. Every process must run the same number of
//! collectives, so iteration counts are fixed per size rather than chosen
//! adaptively per process (as criterion and divan would): each row is the
//! median of 5 rounds, the contenders interleaved round by round.
//! `STAGECRAFT_ALLREDUCE_SIZES="4 KiB,1 MiB"` runs only the sizes named.

mod common;
use common::host;
use stagecraft::distributed::{self, Reduction};
use stagecraft::{Device, Tensor};
use std::process::Command;
use std::time::Instant;

const SIZES: [(usize, &str, usize); 3] = [
    (4 << 10, "4 KiB", 2000),
    (1 << 20, "1 MiB", 200),
    (64 << 20, "64 MiB", 6),
];
const ROUNDS: usize = 5;

fn main() {
    if std::env::var_os("OMPI_COMM_WORLD_SIZE").is_none() {
        let exe = std::env::current_exe().expect("the bench's own path");
        let status = Command::new("mpirun")
            .args(["--oversubscribe", "-np", "2"])
            .arg(exe)
            .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
            .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
            .status()
            .expect("mpirun runs (scripts/mpi.sh installs Open MPI)");
        std::process::exit(status.code().unwrap_or(1));
    }
    let group = distributed::init().expect("joining the MPI job");
    let world = distributed::rsmpi::topology::SimpleCommunicator::world();
    let root = group.is_root();
    if root {
        println!("all-reduce (sum, f32) on {}; {}", group.describe(), host());
        println!(
            "{:>8} {:>11} {:>11} {:>11} {:>11} {:>9} {:>11} {:>12}",
            "size",
            "rsmpi GB/s",
            "op GB/s",
            "comm GB/s",
            "Irsmpi GB/s",
            "op/rsmpi",
            "comm/rsmpi",
            "comm/Irsmpi"
        );
    }
    // `STAGECRAFT_ALLREDUCE_SIZES="4 KiB"` runs only the sizes named.
    let only = std::env::var("STAGECRAFT_ALLREDUCE_SIZES").ok();
    for (bytes, label, iterations) in SIZES {
        if only
            .as_ref()
            .is_some_and(|only| !only.split(',').any(|s| s.trim() == label))
        {
            continue;
        }
        let n = bytes / 4;
        let host_values = vec![1.0f32; n];
        let mut received = vec![0.0f32; n];
        let x = Tensor::<f32>::from_vec(host_values.clone(), &[n], &Device::cpu()).unwrap();
        let dense = stagecraft::layers::tensor::DenseHostTensor::from_slice(
            &host_values,
            stagecraft::layers::tensor::Shape::new(&[n]),
        )
        .unwrap();
        let comm = distributed::communicator();
        let mut times = [Vec::new(), Vec::new(), Vec::new(), Vec::new()];
        for _ in 0..ROUNDS {
            use distributed::rsmpi::traits::*;
            world.barrier();
            let start = Instant::now();
            for _ in 0..iterations {
                world.all_reduce_into(
                    &host_values[..],
                    &mut received[..],
                    distributed::rsmpi::collective::SystemOperation::sum(),
                );
            }
            times[0].push(start.elapsed().as_secs_f64() / iterations as f64);
            world.barrier();
            let start = Instant::now();
            for _ in 0..iterations {
                distributed::all_reduce(&x, Reduction::Sum).wait().unwrap();
            }
            times[1].push(start.elapsed().as_secs_f64() / iterations as f64);
            world.barrier();
            let meta = dense.metadata().clone();
            let start = Instant::now();
            for _ in 0..iterations {
                let op = distributed::Collective::AllReduce(Reduction::Sum);
                comm.start(op, dense.clone(), &meta)
                    .unwrap()
                    .wait()
                    .unwrap();
            }
            times[2].push(start.elapsed().as_secs_f64() / iterations as f64);
            world.barrier();
            let start = Instant::now();
            for _ in 0..iterations {
                distributed::rsmpi::request::scope(|scope| {
                    world
                        .immediate_all_reduce_into(
                            scope,
                            &host_values[..],
                            &mut received[..],
                            distributed::rsmpi::collective::SystemOperation::sum(),
                        )
                        .wait();
                });
            }
            times[3].push(start.elapsed().as_secs_f64() / iterations as f64);
        }
        assert!(received.iter().all(|&v| v == 2.0), "rsmpi's sum is wrong");
        let gbps: Vec<f64> = times
            .iter_mut()
            .map(|t| {
                t.sort_by(f64::total_cmp);
                bytes as f64 / t[ROUNDS / 2] / 1e9
            })
            .collect();
        if root {
            println!(
                "{label:>8} {:>11.3} {:>11.3} {:>11.3} {:>11.3} {:>9.2} {:>11.2} {:>12.2}",
                gbps[0],
                gbps[1],
                gbps[2],
                gbps[3],
                gbps[1] / gbps[0],
                gbps[2] / gbps[0],
                gbps[2] / gbps[3]
            );
        }
    }
}
