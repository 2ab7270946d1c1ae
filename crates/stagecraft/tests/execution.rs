//! Execution modes, threads, placement, buffer reuse, chains and logging.

use stagecraft::layers::runtime::{self as rt, LoggingOpHandler};
use stagecraft::layers::tensor::HostTensor;
use stagecraft::{with_device, with_execution_mode, Device, ExecutionMode, Rng, Tensor};
use std::sync::{Arc, Mutex};

/// A small model touching most op families.
fn program(seed: u64, cpu: &Device) -> Vec<f32> {
    let mut rng = Rng::new(seed);
    let x = Tensor::<f32>::rand_normal(&[16, 32], 0.0, 1.0, &mut rng, cpu);
    let w1 = Tensor::<f32>::rand_uniform(&[32, 64], -0.2, 0.2, &mut rng, cpu);
    let w2 = Tensor::<f32>::rand_uniform(&[64, 10], -0.2, 0.2, &mut rng, cpu);
    let h = (x.matmul(&w1) + 0.1).gelu();
    let logits = h.matmul(&w2).tanh() * 3.0;
    let p = logits.log_softmax(-1);
    let img = x.reshape(&[2, 8, 4, 8]);
    let conv = img.conv2d(&Tensor::ones(&[3, 8, 3, 3], cpu), Default::default());
    let pooled = conv.max_pool2d(stagecraft::Pool2dOptions::new([2, 2]));
    let mut out = p.sum(&[0], false).to_vec().unwrap();
    out.extend(pooled.mean(&[], false).to_vec().unwrap());
    out.extend(logits.argmax(-1, false).cast::<f32>().to_vec().unwrap());
    out
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

#[test]
fn sync_and_async_are_bit_identical() {
    let cpu = Device::cpu();
    let sync = program(7, &cpu);
    let asyncr = with_execution_mode(ExecutionMode::Async, || program(7, &cpu));
    assert_eq!(bits(&sync), bits(&asyncr));
    assert_ne!(bits(&sync), bits(&program(8, &cpu)), "the seed matters");
}

#[test]
fn async_execute_returns_before_the_kernel_runs() {
    let cpu = Device::cpu();
    with_execution_mode(ExecutionMode::Async, || {
        let a = Tensor::<f32>::ones(&[512, 512], &cpu);
        let mut y = a.clone();
        for _ in 0..20 {
            y = y.matmul(&a) * (1.0 / 512.0);
        }
        // Metadata is synchronous even though values are pending.
        assert_eq!(y.dims(), &[512, 512]);
        assert!(y.to_vec().unwrap().iter().all(|&v| (v - 1.0).abs() < 1e-4));
    });
}

#[test]
fn eight_threads_execute_concurrently() {
    let cpu = Device::cpu();
    let expected = program(3, &cpu);
    let threads: Vec<_> = (0..8)
        .map(|i| {
            std::thread::spawn(move || {
                let cpu = Device::cpu();
                let mode = if i % 2 == 0 {
                    ExecutionMode::Sync
                } else {
                    ExecutionMode::Async
                };
                with_execution_mode(mode, || {
                    (0..5).map(|_| program(3, &cpu)).collect::<Vec<_>>()
                })
            })
        })
        .collect();
    for t in threads {
        for run in t.join().unwrap() {
            assert_eq!(bits(&run), bits(&expected));
        }
    }
}

#[test]
fn device_scopes_are_per_thread_and_nest() {
    let cpu0 = Device::cpu();
    let cpu1 = Device::parse("cpu:1").unwrap();
    let cpu2 = Device::parse("cpu:2").unwrap();
    let barrier = Arc::new(std::sync::Barrier::new(2));
    let b = barrier.clone();
    let other = std::thread::spawn(move || {
        with_device(&cpu2, || {
            b.wait();
            b.wait();
            Tensor::<f32>::arange(0.0, 3.0, 1.0, &cpu2).device()
        })
    });
    with_device(&cpu1, || {
        barrier.wait();
        let t = Tensor::<f32>::zeros(&[2], &cpu1) + 1.0;
        assert_eq!(t.device(), cpu1);
        assert_eq!(rt::scoped_device(), Some(cpu1));
        with_device(&cpu0, || assert_eq!(rt::scoped_device(), Some(cpu0)));
        assert_eq!(rt::scoped_device(), Some(cpu1));
        barrier.wait();
    });
    assert_eq!(other.join().unwrap(), cpu2);
    assert_eq!(rt::scoped_device(), None);
}

#[test]
fn placement_follows_inputs_and_other_devices_arguments_are_copied_under_the_guard() {
    use stagecraft::{take_transfer_log, transfer_guard, transfer_stats, TransferGuard};
    let cpu0 = Device::cpu();
    let cpu1 = Device::parse("cpu:1").unwrap();
    let a = Tensor::<f32>::from_vec(vec![1.0, 2.0], &[2], &cpu1).unwrap();
    let b = (&a * 2.0).exp();
    assert_eq!(b.device(), cpu1, "placed on the inputs' device");
    let c = Tensor::<f32>::ones(&[2], &cpu0);
    // The op runs on its first input's device; `c` is copied there, one
    // counted implicit copy.
    let (copies, implicit) = (rt::stats().device_copies, transfer_stats().implicit);
    let mixed = &a + &c;
    assert_eq!(mixed.device(), cpu1);
    assert_eq!(mixed.to_vec().unwrap(), vec![2.0, 3.0]);
    assert_eq!(rt::stats().device_copies - copies, 1);
    assert!(transfer_stats().implicit > implicit);
    // A scope places the op; both arguments move to it.
    let scoped = stagecraft::with_device(&cpu0, || &a * &a);
    assert_eq!(scoped.device(), cpu0);
    assert_eq!(scoped.to_vec().unwrap(), vec![1.0, 4.0]);
    // The guard logs the copy with its line, or refuses it.
    let line = line!() + 1;
    let logged = transfer_guard(TransferGuard::Log, || &a + &c);
    assert_eq!(logged.to_vec().unwrap(), vec![2.0, 3.0]);
    let log = take_transfer_log();
    assert!(
        log.iter().any(|l| l.contains("from cpu:0 to cpu:1 for Add")
            && l.contains(&format!("execution.rs:{line}"))),
        "{log:?}"
    );
    let line = line!() + 1;
    let refused = transfer_guard(TransferGuard::Disallow, || &a + &c);
    let err = refused.check().unwrap_err();
    assert_eq!(err.kind(), stagecraft::ErrorKind::Device, "{err}");
    assert!(err.to_string().contains(".to_device(&cpu:1)"), "{err}");
    assert_eq!(err.location().unwrap().line(), line, "{err}");

    let before = rt::stats().device_copies;
    let moved = a.to_device(&cpu0);
    assert_eq!(moved.device(), cpu0);
    assert_eq!((&moved + &c).to_vec().unwrap(), vec![2.0, 3.0]);
    assert!(rt::stats().device_copies > before);
}

fn buffer_addr<T: stagecraft::Element>(t: &Tensor<T>) -> usize {
    match t.handle().wait().unwrap() {
        HostTensor::Dense(d) => d.buffer().bytes().as_ptr() as usize,
        HostTensor::Scalar(_) | HostTensor::List(_) => 0,
    }
}

#[test]
fn elementwise_ops_reuse_the_last_reference() {
    let cpu = Device::cpu();
    let a = Tensor::<f32>::from_vec(vec![1.0; 1024], &[1024], &cpu).unwrap();
    let b = Tensor::<f32>::from_vec(vec![2.0; 1024], &[1024], &cpu).unwrap();
    let addr = buffer_addr(&a);
    let c = a + &b; // `a` moved in: its buffer is free to overwrite
    assert_eq!(buffer_addr(&c), addr);
    let d = -((c * 2.0) + 1.0);
    assert_eq!(buffer_addr(&d), addr, "the whole chain ran in one buffer");
    let kept = d.clone();
    let e = d + 1.0; // shared: must not overwrite `kept`
    assert_ne!(buffer_addr(&e), addr);
    assert_eq!(kept.to_vec().unwrap()[0], -7.0);
    assert_eq!(e.to_vec().unwrap()[0], -6.0);
}

#[test]
fn side_effects_run_in_program_order_in_async_mode() {
    let lines: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = lines.clone();
    stagecraft::layers::cpu::set_print_sink(Some(Arc::new(move |l: &str| {
        sink.lock().unwrap().push(l.to_string())
    })));
    let cpu = Device::cpu();
    with_execution_mode(ExecutionMode::Async, || {
        let slow = Tensor::<f32>::ones(&[256, 256], &cpu);
        let mut y = slow.clone();
        for _ in 0..10 {
            y = y.matmul(&slow) * (1.0 / 256.0);
        }
        // The first print depends on slow work, the second on nothing; the
        // chain still orders them as written.
        let _ = y.sum(&[], false).print("first");
        let _ = Tensor::<f32>::scalar(2.0, &cpu).print("second");
        rt::sync_effects();
    });
    stagecraft::layers::cpu::set_print_sink(None);
    let lines = lines.lock().unwrap();
    let first = lines.iter().position(|l| l.starts_with("first"));
    let second = lines.iter().position(|l| l.starts_with("second"));
    assert!(first.is_some() && second.is_some(), "{lines:?}");
    assert!(first < second, "{lines:?}");
}

#[test]
fn logging_handler_logs_inputs_and_outputs() {
    let log: Arc<Mutex<Vec<String>>> = Arc::default();
    let sink = log.clone();
    let handler = LoggingOpHandler::new(
        Device::cpu().handler(),
        Arc::new(move |entry: &str| sink.lock().unwrap().push(entry.to_string())),
    );
    let dev = Device::register("logged-cpu-test", Arc::new(handler)).unwrap();
    let x = Tensor::<f32>::from_vec(vec![1.0, -2.0], &[2], &dev).unwrap();
    let y = x.relu();
    assert_eq!(y.to_vec().unwrap(), vec![1.0, 0.0]);
    assert_eq!(y.device(), dev);
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 1);
    assert!(log[0].starts_with("Relu at "), "{}", log[0]);
    assert!(
        log[0].contains("input 0: f32[2] = [1.0, -2.0]"),
        "{}",
        log[0]
    );
    assert!(
        log[0].contains("output 0: f32[2] = [1.0, 0.0]"),
        "{}",
        log[0]
    );
}

#[test]
fn data_dependent_shapes_are_known_with_the_value() {
    let cpu = Device::cpu();
    let x = Tensor::<f32>::from_vec(vec![0.0, 1.0, 0.0, 2.0, 3.0, 0.0], &[2, 3], &cpu).unwrap();
    for mode in [ExecutionMode::Sync, ExecutionMode::Async] {
        let nz = with_execution_mode(mode, || x.nonzero());
        assert_eq!(nz.dims(), &[3, 2]);
        assert_eq!(nz.to_vec().unwrap(), vec![0, 1, 1, 0, 1, 1]);
    }
}

#[test]
fn kernel_cache_hits_after_first_use() {
    let cpu = Device::parse("cpu:7").unwrap();
    let x = Tensor::<f64>::ones(&[3, 3], &cpu);
    for _ in 0..5 {
        x.sum(&[1], true).wait().unwrap();
    }
    let stats = cpu.handler().kernel_cache_stats().unwrap();
    assert!(stats.hits >= 4, "{stats:?}");
    x.sum(&[0], true).wait().unwrap();
    let after = cpu.handler().kernel_cache_stats().unwrap();
    assert_eq!(
        after.misses,
        stats.misses + 1,
        "new attributes instantiate a new kernel"
    );
}
