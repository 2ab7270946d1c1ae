//! `host_call`: Rust closures on the host inside staged code, through
//! Send/Recv and the rendezvous; graph work that does not wait for the
//! host runs meanwhile. Also the seed's `hostAndGraphCommunication` and
//! `countUntilKeyPressed` programs.

use stagecraft::{host_call, host_call_with, Device, Tensor};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

fn cpu() -> Device {
    Device::cpu()
}

fn f32s(values: &[f32]) -> Tensor<f32> {
    Tensor::from_vec(values.to_vec(), &[values.len()], &cpu()).unwrap()
}

#[test]
fn eager_host_call_runs_the_closure() {
    let x = f32s(&[1.0, 2.0, 3.0]);
    let y = host_call(&x, |v: Vec<f32>| v.iter().map(|e| e * e).collect());
    assert_eq!(y.to_vec().unwrap(), vec![1.0, 4.0, 9.0]);
    let n = host_call_with(&x, &[], |v: Vec<f32>| vec![v.len() as i64]);
    assert_eq!(n.item().unwrap(), 3);
}

#[stagecraft::stage]
fn squares_on_host(x: Tensor<f32>) -> Tensor<f32> {
    let y = &x + 1.0;
    let z = host_call(&y, |v: Vec<f32>| v.iter().map(|e| e * e).collect());
    &z * 2.0
}

#[test]
fn staged_host_call_goes_through_the_host_partition() {
    let out = squares_on_host(f32s(&[1.0, 2.0]));
    assert_eq!(out.to_vec().unwrap(), vec![8.0, 18.0]);
    let text = stagecraft::staged_graphs("squares_on_host").join("\n");
    assert!(text.contains("HostCall"), "{text}");
    assert!(
        text.contains("host"),
        "the node is placed on the host: {text}"
    );
}

#[stagecraft::stage]
fn wrong_length(x: Tensor<f32>) -> Tensor<f32> {
    host_call(&x, |v: Vec<f32>| v[..1].to_vec())
}

#[stagecraft::stage]
fn panicking(x: Tensor<f32>) -> Tensor<f32> {
    host_call(&x, |_: Vec<f32>| panic!("the simulator crashed"))
}

#[test]
fn host_closure_errors_name_the_op() {
    let err = wrong_length(f32s(&[1.0, 2.0])).to_vec().unwrap_err();
    assert_eq!(err.op(), Some("HostCall"), "{err}");
    assert!(err.to_string().contains("returned 1 values"), "{err}");
    let err = panicking(f32s(&[1.0])).to_vec().unwrap_err();
    assert_eq!(err.op(), Some("HostCall"), "{err}");
    assert!(err.to_string().contains("panicked"), "{err}");
}

/// A slow host call and independent graph work: the graph's matmuls run
/// while the host sleeps.
#[stagecraft::stage]
fn overlapped(x: Tensor<f32>, w: Tensor<f32>, sleep_ms: u64, work: usize) -> Tensor<f32> {
    let sent = &x + 1.0;
    let from_host = host_call(&sent, move |v: Vec<f32>| {
        std::thread::sleep(Duration::from_millis(sleep_ms));
        v
    });
    let mut y = w.clone();
    for _ in 0..work {
        y = y.matmul(&w).tanh();
    }
    from_host.sum(&[0], false) + y.sum(&[0, 1], false)
}

fn time(f: impl Fn()) -> Duration {
    // The best of three: the machine may be busy with other work.
    (0..3)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .min()
        .unwrap()
}

#[test]
fn graph_work_overlaps_a_slow_host_call() {
    let x = f32s(&[1.0, 2.0]);
    let w = Tensor::<f32>::full(&[384, 384], 0.001, &cpu());
    let run = |sleep: u64, work: usize| {
        overlapped(x.clone(), w.clone(), sleep, work)
            .wait()
            .unwrap();
    };
    // Find a graph workload of roughly the host call's length.
    let host = Duration::from_millis(300);
    run(0, 1);
    let one = time(|| run(0, 1));
    let work = ((host.as_secs_f64() / one.as_secs_f64().max(1e-4)) as usize).clamp(1, 200);
    run(0, work);
    run(host.as_millis() as u64, work);
    let graph = time(|| run(0, work));
    let both = time(|| run(host.as_millis() as u64, work));
    let longest = graph.max(host);
    println!("host {host:?}, graph {graph:?} ({work} matmuls), both {both:?}");
    assert!(
        both.as_secs_f64() < 1.6 * longest.as_secs_f64(),
        "host {host:?} and graph {graph:?} ({work} matmuls) took {both:?} together, \
         more than 1.6 x the longer one"
    );
}

/// The seed's `hostAndGraphCommunication`: a simulator on the host inside
/// a staged training loop.
#[stagecraft::stage]
fn host_and_graph_communication(values: Tensor<f32>, iterations: Tensor<i64>) -> Tensor<f32> {
    let mut values = values;
    let mut i = Tensor::<i64>::scalar(0, &cpu());
    while i.lt(&iterations) {
        let x = values.tanh();
        let result = host_call(&x, |v: Vec<f32>| v.iter().map(|e| e + 1.0).collect());
        let y = &x * 0.5;
        values = &result * &y;
        i = i + 1;
    }
    values
}

#[test]
fn a_host_simulator_inside_a_staged_loop() {
    let v0 = f32s(&[0.5, -0.25]);
    let out = host_and_graph_communication(v0.clone(), Tensor::scalar(3, &cpu()));
    let mut expected = v0.to_vec().unwrap();
    for _ in 0..3 {
        expected = expected
            .iter()
            .map(|v| {
                let x = v.tanh();
                (x + 1.0) * (x * 0.5)
            })
            .collect();
    }
    let got = out.to_vec().unwrap();
    for (g, e) in got.iter().zip(&expected) {
        assert!((g - e).abs() < 1e-6, "{got:?} vs {expected:?}");
    }
    let text = stagecraft::staged_graphs("host_and_graph_communication").join("\n");
    assert_eq!(text.matches("= While").count(), 1, "{text}");
    assert!(text.contains("HostCall"), "{text}");
}

/// The seed's `countUntilKeyPressed`: a host predicate decides when a
/// staged loop stops.
/// How many times the host was asked whether a key was pressed.
static POLLS: AtomicUsize = AtomicUsize::new(0);

#[stagecraft::stage]
fn count_until_key_pressed(start: Tensor<f32>, after: usize) -> (Tensor<f32>, Tensor<i64>) {
    let mut result = start;
    let mut count = Tensor::<i64>::scalar(0, &cpu());
    while Tensor::scalar(true, &cpu()) {
        let stop = host_call_with(&count, &[], move |_: Vec<i64>| {
            vec![POLLS.fetch_add(1, Ordering::SeqCst) + 1 > after]
        });
        if stop {
            break;
        }
        result = (&result * 1.5).tanh();
        count = count + 1;
    }
    (result, count)
}

#[test]
fn a_host_predicate_stops_a_staged_loop() {
    let (result, count) = count_until_key_pressed(f32s(&[0.1]), 5);
    assert_eq!(count.item().unwrap(), 5);
    assert_eq!(POLLS.load(Ordering::SeqCst), 6, "polled once per iteration");
    let mut r = 0.1f32;
    for _ in 0..5 {
        r = (r * 1.5).tanh();
    }
    assert!((result.item().unwrap() - r).abs() < 1e-6);
}
