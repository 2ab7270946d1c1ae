"""Runs the models `crates/stagecraft/tests/onnx_export.rs` exported in onnxruntime and compares
each output with stagecraft's own (rtol 1e-4, atol 1e-5). Usage: onnx_export_ort.py DIR.
Exits non-zero when a model fails to load or run, or an output differs."""
import glob
import os
import sys

import numpy as np
import onnx
import onnx.numpy_helper
import onnxruntime as ort

d = sys.argv[1]
models = sorted(glob.glob(os.path.join(d, "*.onnx")))
if not models:
    sys.exit(f"no .onnx files in {d}: run the export tests with STAGECRAFT_ONNX_EXPORT_DIR={d}")
print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}")
failed = 0
for path in models:
    case = os.path.basename(path)[: -len(".onnx")]
    onnx.checker.check_model(onnx.load(path), full_check=True)
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    feed = {}
    for i, inp in enumerate(sess.get_inputs()):
        feed[inp.name] = onnx.numpy_helper.to_array(onnx.load_tensor(os.path.join(d, f"{case}_input_{i}.pb")))
    outs = sess.run(None, feed)
    for i, got in enumerate(outs):
        want = onnx.numpy_helper.to_array(onnx.load_tensor(os.path.join(d, f"{case}_output_{i}.pb")))
        ok = got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-5)
        err = float(np.max(np.abs(got - want))) if got.shape == want.shape else float("nan")
        print(f"{'ok  ' if ok else 'FAIL'} {case} output {i}: shape {list(got.shape)}, max |ort - stagecraft| = {err:.3g}")
        failed += not ok
sys.exit(1 if failed else 0)
