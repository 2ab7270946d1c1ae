//! Ops whose output shape depends on input values: `Compress`, `NonZero`
//! and `Unique`; and `ReverseSequence` and `TensorScatter`, whose gather
//! pattern depends on the sequence lengths or write positions.
//!
//! Limitation: stagecraft's shapes are static, so those values (the
//! condition, the tensor, the lengths) must be known before the model
//! runs. They are listed in `static_inputs`: a graph input feeding one is
//! baked per call. A value computed inside the model is refused with an
//! error saying it must be known before the model runs. `NonZero` and
//! `Unique` are computed on the host; `Compress`, `ReverseSequence` and
//! `TensorScatter` gather from their data inputs with known indices, so
//! the data may vary.

use super::{axis, dims, ints_of, scalar_f64, Ctx, Translate};
use crate::error::{OnnxError, Result};
use stagecraft_ops as ops;
use stagecraft_ops::OpAttrs;
use stagecraft_runtime::TensorHandle;
use stagecraft_tensor::DenseHostTensor;
use std::cmp::Ordering;

pub(super) fn lookup(op_type: &str) -> Option<Translate> {
    Some(match op_type {
        "Compress" => compress as Translate,
        "NonZero" => nonzero,
        "Unique" => unique,
        "ReverseSequence" => reverse_sequence,
        "TensorScatter" => tensor_scatter,
        _ => return None,
    })
}

/// The known value of input `i`, or an error saying it must be known.
fn must_know<'a>(c: &'a Ctx<'_>, i: usize, what: &str) -> Result<&'a DenseHostTensor> {
    c.known(i).ok_or_else(|| {
        OnnxError::unsupported(format!(
            "{} needs its {what} (input {i}) known before the model runs; it is computed inside the model",
            c.op_type()
        ))
    })
}

fn gather(c: &Ctx<'_>, x: &TensorHandle, idx: &[i64], a: usize) -> Result<TensorHandle> {
    let idx = c.ints_constant(idx)?;
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    c.op1(&ops::GATHER, &[x.clone(), idx], &attrs)
}

/// `Compress`: the entries (slices along `axis`, or elements of the
/// flattened input) whose condition is true; conditions past the input's
/// length are ignored.
fn compress(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let flags = ints_of(must_know(c, 1, "condition")?)?;
    let d = dims(&x);
    let (x, a) = if c.has_attr("axis") {
        (x, axis(c.attr_int("axis", 0), d.len())?)
    } else {
        let n = d.iter().product();
        (c.reshape(&x, &[n])?, 0)
    };
    let len = dims(&x)[a];
    let idx: Vec<i64> = flags
        .iter()
        .take(len)
        .enumerate()
        .filter(|(_, &f)| f != 0)
        .map(|(i, _)| i as i64)
        .collect();
    Ok(vec![gather(c, &x, &idx, a)?])
}

/// `NonZero`: `[rank, count]` coordinates of the nonzero entries, in
/// row-major order.
fn nonzero(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let t = must_know(c, 0, "input")?;
    let d = t.shape().dims().to_vec();
    let mut hits = Vec::new();
    for i in 0..t.numel() {
        let v = t
            .get_scalar(i)
            .ok_or_else(|| OnnxError::invalid("cannot read the input"))?;
        if scalar_f64(v) != 0.0 {
            hits.push(i);
        }
    }
    let rank = d.len().max(1);
    let mut out = vec![0i64; rank * hits.len()];
    for (j, &flat) in hits.iter().enumerate() {
        let mut rest = flat;
        for a in (0..d.len()).rev() {
            out[a * hits.len() + j] = (rest % d[a]) as i64;
            rest /= d[a];
        }
    }
    // A scalar has one coordinate row of zeros per hit (ONNX gives
    // `[1, count]` for it, as NumPy's `nonzero` of a 1-element array).
    Ok(vec![c.constant(DenseHostTensor::from_slice(
        &out,
        [rank, hits.len()],
    )?)])
}

/// `Unique` over the flattened input or the slices along `axis`: the
/// distinct entries (ascending when `sorted`, else in order of first
/// appearance), the index of each one's first appearance, each input
/// entry's index into the result, and the counts.
fn unique(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let t = must_know(c, 0, "input")?;
    let d = t.shape().dims().to_vec();
    let (x, a) = if c.has_attr("axis") {
        (x, axis(c.attr_int("axis", 0), d.len())?)
    } else {
        let n = d.iter().product();
        (c.reshape(&x, &[n])?, 0)
    };
    let xd = dims(&x);
    let n = xd[a];
    let inner: usize = xd[a + 1..].iter().product();
    let mut keys: Vec<Vec<f64>> = vec![Vec::new(); n];
    for i in 0..t.numel() {
        let v = t
            .get_scalar(i)
            .ok_or_else(|| OnnxError::invalid("cannot read the input"))?;
        keys[(i / inner.max(1)) % n.max(1)].push(scalar_f64(v));
    }
    let cmp = |p: &Vec<f64>, q: &Vec<f64>| -> Ordering {
        p.iter()
            .zip(q)
            .map(|(u, v)| u.total_cmp(v))
            .find(|o| *o != Ordering::Equal)
            .unwrap_or(Ordering::Equal)
    };
    // First appearances, in order.
    let mut firsts: Vec<usize> = Vec::new();
    let mut which = vec![0usize; n];
    for i in 0..n {
        match firsts
            .iter()
            .position(|&f| cmp(&keys[f], &keys[i]) == Ordering::Equal)
        {
            Some(u) => which[i] = u,
            None => {
                which[i] = firsts.len();
                firsts.push(i);
            }
        }
    }
    let mut order: Vec<usize> = (0..firsts.len()).collect();
    if c.attr_int("sorted", 1) != 0 {
        order.sort_by(|&p, &q| cmp(&keys[firsts[p]], &keys[firsts[q]]));
    }
    let mut rank_of = vec![0usize; firsts.len()];
    for (r, &u) in order.iter().enumerate() {
        rank_of[u] = r;
    }
    let indices: Vec<i64> = order.iter().map(|&u| firsts[u] as i64).collect();
    let inverse: Vec<i64> = which.iter().map(|&u| rank_of[u] as i64).collect();
    let mut counts = vec![0i64; firsts.len()];
    for &u in &which {
        counts[rank_of[u]] += 1;
    }
    let y = gather(c, &x, &indices, a)?;
    Ok(vec![
        y,
        c.ints_constant(&indices)?,
        c.ints_constant(&inverse)?,
        c.ints_constant(&counts)?,
    ])
}

/// `ReverseSequence`: along `time_axis`, the first `sequence_lens[b]`
/// entries of each batch entry `b` reversed, the rest kept; a gather with
/// indices built from the known lengths.
fn reverse_sequence(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let x = c.input(0)?;
    let lens = ints_of(must_know(c, 1, "sequence_lens")?)?;
    let d = dims(&x);
    if d.len() < 2 {
        return Err(OnnxError::invalid(format!(
            "ReverseSequence input {d:?} has rank < 2"
        )));
    }
    let ta = axis(c.attr_int("time_axis", 0), d.len())?;
    let ba = axis(c.attr_int("batch_axis", 1), d.len())?;
    if ta == ba || ta > 1 || ba > 1 || lens.len() != d[ba] {
        return Err(OnnxError::invalid(format!(
            "time_axis {ta}, batch_axis {ba} and {} lengths do not fit {d:?}",
            lens.len()
        )));
    }
    if let Some(l) = lens.iter().find(|&&l| l < 0 || l as usize > d[ta]) {
        return Err(OnnxError::invalid(format!(
            "sequence length {l} is outside 0..={}",
            d[ta]
        )));
    }
    let numel: usize = d.iter().product();
    let inner: usize = d[2..].iter().product();
    let idx: Vec<i64> = (0..numel)
        .map(|i| {
            let (i0, i1) = ((i / inner) / d[1], (i / inner) % d[1]);
            let (t, b) = if ta == 0 { (i0, i1) } else { (i1, i0) };
            let l = lens[b] as usize;
            (if t < l { l - 1 - t } else { t }) as i64
        })
        .collect();
    let idx = c.constant(DenseHostTensor::from_slice(&idx, d.clone())?);
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", ta as i64);
    Ok(vec![c.op1(&ops::GATHER_ELEMENTS, &[x, idx], &attrs)?])
}

/// `TensorScatter(past_cache, update, write_indices?)`: each batch entry's
/// update written into the cache along `axis` from its write index (zero
/// when absent), wrapping around in `circular` mode. A gather from the
/// cache and update concatenated along `axis`, with indices built from the
/// known write indices.
fn tensor_scatter(c: &Ctx<'_>) -> Result<Vec<TensorHandle>> {
    let (past, update) = (c.input(0)?, c.input(1)?);
    let (pd, ud) = (dims(&past), dims(&update));
    let r = pd.len();
    let a = axis(c.attr_int("axis", -2), r)?;
    if a == 0 || ud.len() != r || (0..r).any(|i| i != a && pd[i] != ud[i]) {
        return Err(OnnxError::invalid(format!(
            "update {ud:?} does not fit cache {pd:?} along axis {a}"
        )));
    }
    let (s, t, b) = (pd[a], ud[a], pd[0]);
    let starts = match c.opt_input(2) {
        Some(_) => ints_of(must_know(c, 2, "write_indices")?)?,
        None => vec![0; b],
    };
    let circular = match c.attr_str("mode", "linear").as_str() {
        "linear" => false,
        "circular" => true,
        other => return Err(OnnxError::invalid(format!("mode '{other}'"))),
    };
    if starts.len() != b
        || starts
            .iter()
            .any(|&w| w < 0 || w as usize > s || (!circular && w as usize + t > s))
    {
        return Err(OnnxError::invalid(format!(
            "write_indices {starts:?} do not fit a cache of {s} with updates of {t}"
        )));
    }
    // Position p of batch entry bi reads the update's step (p - w) mod s
    // when that step exists, else the cache.
    let inner: usize = pd[a + 1..].iter().product();
    let numel: usize = pd.iter().product();
    let idx: Vec<i64> = (0..numel)
        .map(|i| {
            let p = (i / inner) % s;
            let bi = i / (numel / b);
            let w = starts[bi] as usize;
            let step = (p + s - w % s.max(1)) % s.max(1);
            let written = if circular {
                step < t
            } else {
                p >= w && p < w + t
            };
            // Circular updates longer than the cache wrap more than
            // once: the last step landing on p wins.
            let last = if circular && written {
                step + s * ((t - 1 - step) / s)
            } else {
                p.wrapping_sub(w)
            };
            (if written { s + last } else { p }) as i64
        })
        .collect();
    let mut attrs = OpAttrs::new();
    attrs.set_int("axis", a as i64);
    let both = c.op1(&ops::CONCAT, &[past, update], &attrs)?;
    let idx = c.constant(DenseHostTensor::from_slice(&idx, pd.clone())?);
    Ok(vec![c.op1(&ops::GATHER_ELEMENTS, &[both, idx], &attrs)?])
}
