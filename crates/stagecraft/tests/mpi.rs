//! Collectives across processes, run under `mpirun`.
//!
//! `cargo test -p stagecraft --features mpi --test mpi` runs this file's
//! `main`, which launches itself under `mpirun -np 2` once per scenario
//! (as a worker: `STAGECRAFT_MPI_WORKER=<scenario>`) and checks what the
//! workers printed, their exit status and how long they took. Workers
//! check their own results and exit non-zero on a wrong one. Every
//! scenario's collectives run in one `main` thread, in the same order on
//! every rank, as collectives require (the libtest harness would run
//! tests on parallel threads).

use stagecraft::distributed::{self, DataParallel, Reduction};
use stagecraft::nn::{Forward, Linear, ModuleExt};
use stagecraft::{function, grad, lazy, with_device, Device, Rng, Tensor};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn main() {
    match std::env::var("STAGECRAFT_MPI_WORKER") {
        Ok(scenario) => worker(&scenario),
        Err(_) => launcher(),
    }
}

// ---------------------------------------------------------------------------
// The launcher: one `mpirun` per scenario.

struct Run {
    output: String,
    success: bool,
    took: Duration,
}

fn mpirun(scenario: &str, ranks: usize, env: &[(&str, &str)]) -> Run {
    let exe = std::env::current_exe().expect("the test's own path");
    let mut cmd = Command::new("mpirun");
    cmd.args(["--oversubscribe", "-np", &ranks.to_string()])
        .arg(exe)
        .env("STAGECRAFT_MPI_WORKER", scenario)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    let start = Instant::now();
    let out = cmd.output().unwrap_or_else(|e| {
        panic!("cannot run mpirun ({e}): install Open MPI with scripts/mpi.sh")
    });
    Run {
        output: format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
        success: out.status.success(),
        took: start.elapsed(),
    }
}

fn launcher() {
    type Check = fn() -> Result<(), String>;
    let checks: &[(&str, Check)] = &[
        ("collectives give MPI's results on 2 ranks", || {
            expect_success("collectives", 2)
        }),
        ("gradients of collectives", || {
            expect_success("gradients", 2)
        }),
        ("collectives in lazy traces and functions", || {
            expect_success("staged", 2)
        }),
        (
            "bucketed data-parallel gradients equal full-batch ones",
            || expect_success("data_parallel", 2),
        ),
        ("... on the lazy device, buckets in one trace", || {
            expect_success("data_parallel_lazy", 2)
        }),
        ("three ranks", || expect_success("collectives", 3)),
        (
            "all-reduces of every size agree bit for bit on 2 ranks",
            || expect_success("all_reduce_sizes", 2),
        ),
        ("... on 1 rank", || expect_success("all_reduce_sizes", 1)),
        ("... on 3 ranks (one folded in)", || {
            expect_success("all_reduce_sizes", 3)
        }),
        ("... on 4 ranks (two rounds)", || {
            expect_success("all_reduce_sizes", 4)
        }),
        (
            "a model split across two ranks gives the single-process result",
            || expect_success("pipeline", 2),
        ),
        ("a pipeline on two of three ranks", || {
            expect_success("pipeline", 3)
        }),
        (
            "an error on one rank reaches the rank waiting for it",
            pipeline_failure,
        ),
        ("a rank that never sends is named", pipeline_silence),
        (
            "ranks sending different shapes are told so",
            pipeline_mismatch,
        ),
        ("a shape mismatch is reported on every rank", mismatch),
        (
            "... when the ranks send different numbers of fragments",
            || {
                expect_mismatch(
                    "mismatch_fragments",
                    "rank 0 ran AllReduce AllReduce(sum) f32[3]; rank 1 ran AllReduce AllReduce(sum) f32[3000]",
                )
            },
        ),
        ("... when the folded one of three ranks differs", || {
            expect_mismatch_on(
                "mismatch_folded",
                3,
                "rank 0 ran AllReduce AllReduce(sum) f32[3]; rank 1 ran AllReduce AllReduce(sum) f32[3]; rank 2 ran AllReduce AllReduce(sum) f32[3000]",
            )
        }),
        ("... when one rank's schedule is split in halves", || {
            expect_mismatch(
                "mismatch_split",
                "rank 0 ran AllReduce AllReduce(sum) f32[1000]; rank 1 ran AllReduce AllReduce(sum) f32[20000]",
            )
        }),
        (
            "an all-reduce against a broadcast is reported on every rank",
            mismatched_kinds,
        ),
        ("a hung rank is named within 10 s", hang),
        ("a dead rank stops the job within 10 s", death),
        ("Ctrl-C on mpirun leaves no process behind", interrupt),
    ];
    let (mut passed, mut failed) = (0, 0);
    for (name, check) in checks {
        match check() {
            Ok(()) => {
                println!("test {name} ... ok");
                passed += 1;
            }
            Err(why) => {
                println!("test {name} ... FAILED\n{why}");
                failed += 1;
            }
        }
    }
    println!("{passed} passed, {failed} failed");
    if failed > 0 {
        std::process::exit(1);
    }
}

fn expect_success(scenario: &str, ranks: usize) -> Result<(), String> {
    let run = mpirun(scenario, ranks, &[]);
    let oks = run.output.matches("worker ok").count();
    if run.success && oks == ranks {
        Ok(())
    } else {
        Err(format!(
            "{ranks} ranks of `{scenario}` did not all pass:\n{}",
            run.output
        ))
    }
}

fn mismatch() -> Result<(), String> {
    expect_mismatch(
        "mismatch",
        "rank 0 ran AllReduce AllReduce(sum) f32[3]; rank 1 ran AllReduce AllReduce(sum) f32[4]",
    )
}

fn mismatched_kinds() -> Result<(), String> {
    expect_mismatch(
        "mismatched_kinds",
        "rank 0 ran AllReduce AllReduce(sum) f32[3]; rank 1 ran Broadcast Broadcast(root 0) f32[3]",
    )
}

/// Both ranks of `scenario` must report, within 10 s, that the
/// collective differs between them, saying `what_each_ran`.
fn expect_mismatch(scenario: &str, what_each_ran: &str) -> Result<(), String> {
    expect_mismatch_on(scenario, 2, what_each_ran)
}

/// [`expect_mismatch`] on `ranks` ranks, every one reporting.
fn expect_mismatch_on(scenario: &str, ranks: usize, what_each_ran: &str) -> Result<(), String> {
    let run = mpirun(scenario, ranks, &[]);
    let report = format!("differs between processes: {what_each_ran}");
    if run.output.matches(&report).count() == ranks && run.took < Duration::from_secs(10) {
        Ok(())
    } else {
        Err(format!(
            "expected both ranks to report the mismatch ({:?}):\n{}",
            run.took, run.output
        ))
    }
}

/// Runs `scenario` on 2 ranks with the collective timeout `timeout` (in
/// seconds): both must end well within `within`, both must print
/// "worker ok", and the output must say everything in `reported`.
fn expect_reported(
    scenario: &str,
    timeout: &str,
    within: Duration,
    reported: &[&str],
) -> Result<(), String> {
    let run = mpirun(scenario, 2, &[("STAGECRAFT_COLLECTIVE_TIMEOUT", timeout)]);
    let missing: Vec<&&str> = reported
        .iter()
        .filter(|r| !run.output.contains(**r))
        .collect();
    let oks = run.output.matches("worker ok").count();
    if missing.is_empty() && oks == 2 && run.success && run.took < within {
        Ok(())
    } else {
        Err(format!(
            "`{scenario}`: expected both ranks to end within {within:?} (took {:?}), reporting \
             {missing:?}:\n{}",
            run.took, run.output
        ))
    }
}

fn pipeline_failure() -> Result<(), String> {
    // A long timeout: the cause must arrive with the failure, not after it.
    expect_reported(
        "pipeline_failure",
        "30",
        Duration::from_secs(10),
        &["rank 0 failed, so it never sent", "(run 0): Div at"],
    )
}

fn pipeline_silence() -> Result<(), String> {
    expect_reported(
        "pipeline_silence",
        "2",
        Duration::from_secs(15),
        &[
            "rank 0 did not send function#edge0:/rank:0/cpu:0->/rank:1/cpu:0 (run 0) to rank 1 \
           within 2.0 s",
        ],
    )
}

fn pipeline_mismatch() -> Result<(), String> {
    expect_reported(
        "pipeline_mismatch",
        "30",
        Duration::from_secs(10),
        &[
            "rank 0 sent 16 bytes for function#edge0:/rank:0/cpu:0->/rank:1/cpu:0 (run 0), which \
           carries f32[5] (20 bytes)",
        ],
    )
}

fn hang() -> Result<(), String> {
    let run = mpirun("hang", 2, &[("STAGECRAFT_COLLECTIVE_TIMEOUT", "4")]);
    let named = run.output.contains("rank 1 did not reach collective #1");
    if named && !run.success && run.took < Duration::from_secs(10) {
        Ok(())
    } else {
        Err(format!(
            "expected rank 0 to name rank 1 and the job to stop within 10 s ({:?}):\n{}",
            run.took, run.output
        ))
    }
}

fn death() -> Result<(), String> {
    let run = mpirun("death", 2, &[("STAGECRAFT_COLLECTIVE_TIMEOUT", "4")]);
    // Either mpirun notices the exit first and names the process, or rank
    // 0's watchdog does.
    let named = run.output.contains("rank 1 did not reach")
        || (run.output.contains("exited") && run.output.contains(",1]"));
    if named && !run.success && run.took < Duration::from_secs(10) {
        Ok(())
    } else {
        Err(format!(
            "expected the job to stop within 10 s naming rank 1 ({:?}):\n{}",
            run.took, run.output
        ))
    }
}

fn interrupt() -> Result<(), String> {
    let exe = std::env::current_exe().expect("the test's own path");
    let marker = format!("interrupt-{}", std::process::id());
    let mut child = Command::new("mpirun")
        .args(["--oversubscribe", "-np", "2"])
        .arg(&exe)
        .env("STAGECRAFT_MPI_WORKER", &marker)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| format!("cannot run mpirun: {e}"))?;
    // Let both workers start their endless loop of collectives.
    let deadline = Instant::now() + Duration::from_secs(20);
    while workers(&marker) < 2 && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    std::thread::sleep(Duration::from_millis(500));
    let started = workers(&marker);
    // SAFETY: sending SIGINT to the child we spawned, as Ctrl-C would.
    let rc = unsafe { libc_kill(child.id() as i32, 2) };
    if rc != 0 {
        return Err("could not signal mpirun".into());
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            return Err("mpirun did not stop within 10 s of SIGINT".into());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    std::thread::sleep(Duration::from_millis(300));
    let left = workers(&marker);
    if started == 2 && left == 0 {
        Ok(())
    } else {
        Err(format!(
            "{started} workers were running before SIGINT and {left} are left after it"
        ))
    }
}

extern "C" {
    #[link_name = "kill"]
    fn libc_kill(pid: i32, signal: i32) -> i32;
}

/// Processes whose environment carries `marker` as their scenario.
fn workers(marker: &str) -> usize {
    let needle = format!("STAGECRAFT_MPI_WORKER={marker}");
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return 0;
    };
    dir.filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().parse::<u32>().is_ok())
        .filter(|e| {
            std::fs::read(e.path().join("environ"))
                .map(|env| env.split(|&b| b == 0).any(|var| var == needle.as_bytes()))
                .unwrap_or(false)
        })
        .filter(|e| {
            // mpirun itself carries the variable too; count the workers.
            std::fs::read_to_string(e.path().join("comm"))
                .map(|c| !c.trim().starts_with("mpirun") && !c.trim().starts_with("orted"))
                .unwrap_or(false)
        })
        .count()
}

// ---------------------------------------------------------------------------
// The workers.

fn worker(scenario: &str) {
    let group = distributed::init().expect("joining the MPI job");
    let rank = group.rank();
    let result = match scenario {
        "collectives" => collectives(rank, group.size()),
        "gradients" => gradients(rank, group.size()),
        "staged" => staged(rank, group.size()),
        "data_parallel" => data_parallel(rank, group.size(), Device::cpu()),
        "data_parallel_lazy" => data_parallel(rank, group.size(), Device::lazy(&Device::cpu())),
        "pipeline" => pipeline(),
        "pipeline_failure" => pipeline_failure_worker(rank),
        "pipeline_silence" | "pipeline_mismatch" => pipeline_fault(scenario, rank),
        "all_reduce_sizes" => all_reduce_sizes(rank, group.size()),
        "mismatch" | "mismatch_fragments" | "mismatch_split" | "mismatch_folded"
        | "mismatched_kinds" => {
            // Each rank's length: one more value; one fragment against
            // three; two fragments against a split schedule's halves; the
            // process folded into rank 0 (of 3) alone with three fragments.
            let lengths: &[usize] = match scenario {
                "mismatch" => &[3, 4],
                "mismatch_fragments" => &[3, 3000],
                "mismatch_folded" => &[3, 3, 3000],
                _ => &[1000, 20000],
            };
            let y = if scenario != "mismatched_kinds" {
                let x = Tensor::<f32>::ones(&[lengths[rank]], &Device::cpu());
                distributed::all_reduce(&x, Reduction::Sum)
            } else {
                let x = Tensor::<f32>::ones(&[3], &Device::cpu());
                match rank {
                    0 => distributed::all_reduce(&x, Reduction::Sum),
                    _ => distributed::broadcast(&x, 0),
                }
            };
            match y.to_vec() {
                Ok(v) => Err(format!("a mismatched all-reduce returned {v:?}")),
                Err(e) => {
                    println!("rank {rank}: {e}");
                    // The group has failed: end the job without finalizing,
                    // once the other rank has had time to report too.
                    std::thread::sleep(Duration::from_secs(1));
                    group.abort(0);
                }
            }
        }
        "hang" | "death" => {
            let x = Tensor::<f32>::ones(&[8], &Device::cpu());
            // Collective #0 succeeds; rank 1 then hangs (or dies) before #1.
            let _ = distributed::all_reduce(&x, Reduction::Sum).to_vec();
            if rank == 1 {
                if scenario == "death" {
                    std::process::exit(3);
                }
                std::thread::sleep(Duration::from_secs(60));
            }
            match distributed::all_reduce(&x, Reduction::Sum).to_vec() {
                Ok(_) => Err("the all-reduce completed without rank 1".into()),
                Err(e) => {
                    println!("rank {rank}: {e}");
                    group.abort(1);
                }
            }
        }
        other if other.starts_with("interrupt") => {
            let x = Tensor::<f32>::ones(&[1024], &Device::cpu());
            let until = Instant::now() + Duration::from_secs(60);
            while Instant::now() < until {
                let _ = distributed::all_reduce(&x, Reduction::Sum).to_vec();
                std::thread::sleep(Duration::from_millis(10));
            }
            Ok(())
        }
        other => Err(format!("unknown scenario {other}")),
    };
    match result {
        Ok(()) => println!("rank {rank}: worker ok"),
        Err(why) => {
            eprintln!("rank {rank}: {why}");
            group.abort(1);
        }
    }
}

fn same(what: &str, got: Vec<f32>, want: Vec<f32>) -> Result<(), String> {
    if got == want {
        Ok(())
    } else {
        Err(format!("{what}: got {got:?}, want {want:?}"))
    }
}

/// `[rank + 1, 10 (rank + 1), -(rank + 1)]`
fn ranked(rank: usize, device: &Device) -> Tensor<f32> {
    let r = (rank + 1) as f32;
    Tensor::from_vec(vec![r, 10.0 * r, -r], &[3], device).unwrap()
}

fn collectives(rank: usize, n: usize) -> Result<(), String> {
    let cpu = Device::cpu();
    let x = ranked(rank, &cpu);
    let total: f32 = (1..=n).map(|r| r as f32).sum();
    let nf = n as f32;
    let v = |t: Tensor<f32>| t.to_vec().map_err(|e| e.to_string());
    same(
        "sum",
        v(distributed::all_reduce(&x, Reduction::Sum))?,
        vec![total, 10.0 * total, -total],
    )?;
    same(
        "mean",
        v(distributed::all_reduce(&x, Reduction::Mean))?,
        vec![total / nf, 10.0 * total / nf, -total / nf],
    )?;
    same(
        "max",
        v(distributed::all_reduce(&x, Reduction::Max))?,
        vec![nf, 10.0 * nf, -1.0],
    )?;
    same(
        "min",
        v(distributed::all_reduce(&x, Reduction::Min))?,
        vec![1.0, 10.0, -nf],
    )?;
    let ints = Tensor::<i64>::from_vec(vec![rank as i64, 7], &[2], &cpu).unwrap();
    let summed = distributed::all_reduce(&ints, Reduction::Sum)
        .to_vec()
        .map_err(|e| e.to_string())?;
    if summed != vec![(n * (n - 1) / 2) as i64, 7 * n as i64] {
        return Err(format!("i64 sum: {summed:?}"));
    }
    let root = n - 1;
    same(
        "broadcast",
        v(distributed::broadcast(&x, root))?,
        ranked(root, &cpu).to_vec().unwrap(),
    )?;
    let reduced = v(distributed::reduce_to_root(&x, Reduction::Sum, root))?;
    let want = if rank == root {
        vec![total, 10.0 * total, -total]
    } else {
        vec![0.0; 3]
    };
    same("reduce to root", reduced, want)?;
    let gathered = v(distributed::all_gather(&x.reshape(&[1, 3])))?;
    let want: Vec<f32> = (0..n)
        .flat_map(|r| ranked(r, &cpu).to_vec().unwrap())
        .collect();
    same("all-gather", gathered, want)?;
    // Rank r's part of the sum of [n, 2] tensors filled with rank + 1.
    let rows = Tensor::<f32>::full(&[n, 2], (rank + 1) as f32, &cpu);
    same(
        "reduce-scatter",
        v(distributed::reduce_scatter(&rows, Reduction::Sum))?,
        vec![total; 2],
    )?;
    let started = distributed::all_reduce_start(&x, Reduction::Sum);
    let meanwhile = (&x * &x).to_vec().unwrap();
    same(
        "start/done",
        v(started.wait())?,
        vec![total, 10.0 * total, -total],
    )?;
    same(
        "work between start and done",
        meanwhile,
        [1.0, 100.0, 1.0]
            .iter()
            .map(|scale| ((rank + 1) as f32).powi(2) * scale)
            .collect(),
    )?;
    // A larger reduction, past Open MPI's eager limit.
    let big = Tensor::<f32>::full(&[1 << 20], (rank + 1) as f32, &cpu);
    let sum = distributed::all_reduce(&big, Reduction::Sum)
        .to_vec()
        .unwrap();
    if sum.iter().any(|&s| s != total) {
        return Err("a 4 MiB all-reduce gave a wrong element".into());
    }
    Ok(())
}

/// Sizes around each split of the all-reduce's schedule (fewer elements
/// than processes, odd halves, the eager limit, many MiB), in every dtype
/// the schedule reduces itself: every rank must get the reduction, and
/// float sums (whose bits depend on the order of their terms) must agree
/// bit for bit across ranks.
fn all_reduce_sizes(rank: usize, n: usize) -> Result<(), String> {
    let cpu = Device::cpu();
    for len in [0usize, 1, 2, 3, 7, 1023, 1024, 1025, 70_001, 3 << 20] {
        // Values whose sum depends on the order of its terms.
        let values: Vec<f32> = (0..len)
            .map(|i| ((i * 7919 + rank * 104_729) % 1000) as f32 / 7.0 + rank as f32 * 0.1)
            .collect();
        let x = Tensor::<f32>::from_vec(values, &[len], &cpu).unwrap();
        let sum = distributed::all_reduce(&x, Reduction::Sum);
        let all = distributed::all_gather(&sum.reshape(&[1, len]))
            .to_vec()
            .map_err(|e| e.to_string())?;
        let mine = sum.to_vec().map_err(|e| e.to_string())?;
        for (r, theirs) in all
            .chunks(len.max(1))
            .enumerate()
            .take(if len == 0 { 0 } else { n })
        {
            if theirs
                .iter()
                .zip(&mine)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                return Err(format!(
                    "{len} values: rank {r}'s sum differs from rank {rank}'s"
                ));
            }
        }
        for (i, &s) in mine.iter().enumerate() {
            let want: f64 = (0..n)
                .map(|r| ((i * 7919 + r * 104_729) % 1000) as f64 / 7.0 + r as f64 * 0.1)
                .sum();
            if (s as f64 - want).abs() > 1e-4 * want.abs().max(1.0) {
                return Err(format!("{len} values: element {i} sums to {s}, not {want}"));
            }
        }
        let ints: Vec<i32> = (0..len).map(|i| (i as i32) * (rank as i32 + 1)).collect();
        let x = Tensor::<i32>::from_vec(ints, &[len], &cpu).unwrap();
        let triangle = (n * (n + 1) / 2) as i32;
        let got = distributed::all_reduce(&x, Reduction::Sum)
            .to_vec()
            .map_err(|e| e.to_string())?;
        if got
            .iter()
            .enumerate()
            .any(|(i, &v)| v != i as i32 * triangle)
        {
            return Err(format!("{len} i32 values: a wrong sum"));
        }
        let wide = Tensor::<f64>::full(&[len], rank as f64 - 0.5, &cpu);
        let (max, min) = (
            distributed::all_reduce(&wide, Reduction::Max).to_vec(),
            distributed::all_reduce(&wide, Reduction::Min).to_vec(),
        );
        let (max, min) = (
            max.map_err(|e| e.to_string())?,
            min.map_err(|e| e.to_string())?,
        );
        if max.iter().any(|&v| v != n as f64 - 1.5) || min.iter().any(|&v| v != -0.5) {
            return Err(format!("{len} f64 values: max {max:?}, min {min:?}"));
        }
        let mean = distributed::all_reduce(
            &Tensor::<f64>::full(&[len], rank as f64, &cpu),
            Reduction::Mean,
        )
        .to_vec()
        .map_err(|e| e.to_string())?;
        if mean.iter().any(|&v| v != (n - 1) as f64 / 2.0) {
            return Err(format!("{len} f64 values: mean {mean:?}"));
        }
    }
    Ok(())
}

fn gradients(rank: usize, n: usize) -> Result<(), String> {
    let cpu = Device::cpu();
    let w = |r: usize| {
        Tensor::<f32>::from_vec(vec![r as f32 + 1.0, 2.0 * r as f32], &[1, 2], &cpu).unwrap()
    };
    // loss_r = Σ all_gather(x) · W_r, with W_r [n, 2] of rows w(r): the
    // gradient of the summed losses at x_r is Σ_r' w(r') = ReduceScatter.
    let x = Tensor::<f32>::ones(&[1, 2], &cpu).requires_grad();
    let rows: Vec<Tensor<f32>> = (0..n).map(|_| w(rank)).collect();
    let weights = Tensor::concat(&rows.iter().collect::<Vec<_>>(), 0);
    let loss = (&distributed::all_gather(&x) * &weights).sum(&[], false);
    let grads = loss.backward().map_err(|e| e.to_string())?;
    let want: Vec<f32> = (0..n).fold(vec![0.0, 0.0], |acc, r| {
        let w = w(r).to_vec().unwrap();
        vec![acc[0] + w[0], acc[1] + w[1]]
    });
    same(
        "AllGather's gradient",
        grads.get(&x).unwrap().to_vec().unwrap(),
        want.clone(),
    )?;
    // The gradient of a sum all-reduce is the sum of the gradients.
    let x = Tensor::<f32>::ones(&[1, 2], &cpu).requires_grad();
    let loss = (&distributed::all_reduce(&x, Reduction::Sum) * &w(rank)).sum(&[], false);
    let grads = loss.backward().map_err(|e| e.to_string())?;
    same(
        "AllReduce's gradient",
        grads.get(&x).unwrap().to_vec().unwrap(),
        want,
    )?;
    // Broadcast's gradient reaches only the root.
    let x = Tensor::<f32>::ones(&[1, 2], &cpu).requires_grad();
    let loss = (&distributed::broadcast(&x, 0) * &w(rank)).sum(&[], false);
    let got = loss
        .backward()
        .map_err(|e| e.to_string())?
        .get(&x)
        .unwrap()
        .to_vec()
        .unwrap();
    let total: Vec<f32> = (0..n).fold(vec![0.0, 0.0], |acc, r| {
        let w = w(r).to_vec().unwrap();
        vec![acc[0] + w[0], acc[1] + w[1]]
    });
    same(
        "Broadcast's gradient",
        got,
        if rank == 0 { total } else { vec![0.0, 0.0] },
    )
}

fn staged(rank: usize, n: usize) -> Result<(), String> {
    let total: f32 = (1..=n).map(|r| r as f32).sum();
    let lazy_cpu = Device::lazy(&Device::cpu());
    lazy::reset_metrics();
    for step in 0..3 {
        let x = ranked(rank, &lazy_cpu);
        let y = &distributed::all_reduce(&(&x * 2.0f32), Reduction::Sum) + 1.0f32;
        lazy::mark_step();
        same(
            &format!("lazy step {step}"),
            y.to_vec().map_err(|e| e.to_string())?,
            vec![2.0 * total + 1.0, 20.0 * total + 1.0, -2.0 * total + 1.0],
        )?;
    }
    let compiled = lazy::metrics().traces_compiled;
    if compiled != 1 {
        return Err(format!("3 lazy steps compiled {compiled} traces"));
    }
    let f = function(|x: Tensor<f32>| distributed::all_reduce(&x, Reduction::Max));
    for _ in 0..2 {
        same(
            "function",
            f.call(ranked(rank, &Device::cpu()))
                .to_vec()
                .map_err(|e| e.to_string())?,
            vec![n as f32, 10.0 * n as f32, -1.0],
        )?;
    }
    Ok(())
}

/// On the lazy device, the bucket reductions are ops of one trace, which
/// the executor reorders to start them early and wait late.
fn data_parallel(rank: usize, n: usize, device: Device) -> Result<(), String> {
    let cpu = device;
    let batch = 4 * n;
    let mut rng = Rng::new(11);
    let x_all = Tensor::<f32>::from_vec(
        (0..batch * 5)
            .map(|i| ((i * 7) % 13) as f32 / 13.0 - 0.5)
            .collect(),
        &[batch, 5],
        &cpu,
    )
    .unwrap();
    // Different initial parameters on each rank: broadcast makes them equal.
    let mut model = stagecraft::nn::Sequential::new()
        .push(Linear::new(
            5,
            8,
            true,
            &mut Rng::new(rank as u64 + 1),
            &cpu,
        ))
        .push(stagecraft::nn::Activation::Tanh)
        .push(Linear::new(8, 3, true, &mut rng, &cpu));
    // Tiny buckets: several reductions in flight during backward.
    let ddp = DataParallel::with_bucket_bytes(&model, 64);
    if ddp.buckets().len() < 3 {
        return Err(format!("expected several buckets, got {:?}", ddp.buckets()));
    }
    ddp.broadcast_parameters(&mut model)
        .map_err(|e| e.to_string())?;
    // The full batch's gradient, on every rank without communication.
    model.requires_grad();
    let full = model.forward(&x_all).square().mean(&[], false);
    let want = full.backward().map_err(|e| e.to_string())?;
    // This rank's shard, averaged over the group.
    model.requires_grad();
    let shard = x_all.narrow(0, rank * 4, 4);
    let local = model.forward(&shard).square().mean(&[], false);
    let got = ddp.backward(&model, &local).map_err(|e| e.to_string())?;
    for (name, p) in model.named_params() {
        let (g, w) = (
            got.get(&p).unwrap().to_vec().unwrap(),
            want.get(&p).unwrap().to_vec().unwrap(),
        );
        let worst = g
            .iter()
            .zip(&w)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        if worst > 1e-6 {
            return Err(format!("{name}: data-parallel gradient differs by {worst}"));
        }
    }
    Ok(())
}

/// Two stages of an MLP: the first on `first`, the second on `second`
/// (both on this process's device when `None`).
fn two_stages(
    x: &Tensor<f32>,
    w1: &Tensor<f32>,
    w2: &Tensor<f32>,
    devices: Option<(Device, Device)>,
) -> Tensor<f32> {
    let first = || x.matmul(w1).relu();
    let h = match devices {
        Some((d, _)) => with_device(&d, first),
        None => first(),
    };
    let second = || (h.matmul(w2) + 0.5f32).tanh().sum(&[-1], false);
    match devices {
        Some((_, d)) => with_device(&d, second),
        None => second(),
    }
}

/// A model split across ranks 0 and 1 (pipeline style), forward and
/// backward, on every process of the group: each gets the results, equal
/// bit for bit to one process's.
fn pipeline() -> Result<(), String> {
    let cpu = Device::cpu();
    let mut rng = Rng::new(21);
    let x = Tensor::<f32>::rand_normal(&[8, 32], 0.0, 1.0, &mut rng, &cpu);
    let w1 = Tensor::<f32>::rand_normal(&[32, 64], 0.0, 0.2, &mut rng, &cpu);
    let w2 = Tensor::<f32>::rand_normal(&[64, 16], 0.0, 0.2, &mut rng, &cpu);
    let stages = Some((
        Device::parse("/rank:0/cpu:0").map_err(|e| e.to_string())?,
        Device::parse("/rank:1/cpu:0").map_err(|e| e.to_string())?,
    ));
    let loss = |x: &Tensor<f32>, w1: &Tensor<f32>, w2: &Tensor<f32>, d| {
        two_stages(x, w1, w2, d).square().sum(&[], false)
    };
    let want_out = two_stages(&x, &w1, &w2, None).to_vec().unwrap();
    let want_grad = grad(|w1: &Tensor<f32>| loss(&x, w1, &w2, None))(&w1)
        .to_vec()
        .unwrap();
    let forward = function(
        move |(x, w1, w2): (Tensor<f32>, Tensor<f32>, Tensor<f32>)| {
            two_stages(&x, &w1, &w2, stages)
        },
    );
    // Backward crosses the ranks the other way: rank 1's gradient of h
    // goes back to rank 0, which finishes w1's.
    let backward = function(
        move |(x, w1, w2): (Tensor<f32>, Tensor<f32>, Tensor<f32>)| {
            grad(|w1: &Tensor<f32>| loss(&x, w1, &w2, stages))(&w1)
        },
    );
    for run in 0..3 {
        let args = (x.clone(), w1.clone(), w2.clone());
        same(
            &format!("forward, run {run}"),
            forward
                .call(args.clone())
                .to_vec()
                .map_err(|e| e.to_string())?,
            want_out.clone(),
        )?;
        same(
            &format!("w1's gradient, run {run}"),
            backward.call(args).to_vec().map_err(|e| e.to_string())?,
            want_grad.clone(),
        )?;
    }
    Ok(())
}

/// Rank 0's stage fails: rank 1, waiting for its output, stops at once
/// with rank 0's error, and both go on to run the next call.
fn pipeline_failure_worker(rank: usize) -> Result<(), String> {
    let cpu = Device::cpu();
    let (r0, r1) = (
        Device::parse("/rank:0/cpu:0").map_err(|e| e.to_string())?,
        Device::parse("/rank:1/cpu:0").map_err(|e| e.to_string())?,
    );
    let f = function(move |(x, d): (Tensor<i32>, Tensor<i32>)| {
        let q = with_device(&r0, || &x / &d);
        with_device(&r1, || q * 2)
    });
    let x = Tensor::<i32>::ones(&[4], &cpu);
    let started = Instant::now();
    let err = match f
        .call((x.clone(), Tensor::<i32>::zeros(&[4], &cpu)))
        .to_vec()
    {
        Ok(v) => return Err(format!("a division by zero gave {v:?}")),
        Err(e) => e,
    };
    println!("rank {rank}: {err}");
    if started.elapsed() > Duration::from_secs(5) {
        return Err(format!("the error took {:?}", started.elapsed()));
    }
    // The next call's messages are not mistaken for the failed one's.
    same(
        "the call after the failure",
        f.call((x.clone(), x))
            .to_vec()
            .map_err(|e| e.to_string())?
            .into_iter()
            .map(|v| v as f32)
            .collect(),
        vec![2.0; 4],
    )
}

/// `pipeline_silence`: rank 0 calls the function late, after rank 1 has
/// given up waiting for its value. `pipeline_mismatch`: rank 1 expects a
/// longer vector than rank 0 sends. Either way both ranks end with an
/// error, not a hang.
fn pipeline_fault(scenario: &str, rank: usize) -> Result<(), String> {
    let cpu = Device::cpu();
    let (r0, r1) = (
        Device::parse("/rank:0/cpu:0").map_err(|e| e.to_string())?,
        Device::parse("/rank:1/cpu:0").map_err(|e| e.to_string())?,
    );
    let f = function(move |x: Tensor<f32>| {
        let y = with_device(&r0, || x.exp());
        with_device(&r1, || y * 2.0f32)
    });
    let n = if scenario == "pipeline_mismatch" && rank == 1 {
        5
    } else {
        4
    };
    if scenario == "pipeline_silence" && rank == 0 {
        // Rank 1 gives up at 2 s (the timeout) and sends rank 0 its error;
        // at exit it gives that send 2 s more (the grace period) to be
        // taken. Calling at 3 s lands between the two with a second's
        // margin each side. At 4 s, exactly at the grace period's end, rank
        // 1 sometimes aborted the job for a send nobody took.
        std::thread::sleep(Duration::from_secs(3));
    }
    match f.call(Tensor::<f32>::ones(&[n], &cpu)).to_vec() {
        Ok(v) => Err(format!("the call returned {v:?}")),
        Err(e) => {
            println!("rank {rank}: {e}");
            Ok(())
        }
    }
}
