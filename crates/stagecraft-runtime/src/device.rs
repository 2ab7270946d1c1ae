//! Devices: named places where tensors live, each bound to the op handler
//! that executes ops there.

use crate::cpu_handler::CpuOpHandler;
use crate::op_handler::OpHandler;
use stagecraft_tensor::{Error, ErrorKind, Result};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

/// The kind of a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DeviceKind {
    /// A host CPU device (`cpu:0` is the machine; `cpu:N` are virtual CPU
    /// devices sharing it).
    Cpu,
    /// A lazy device: ops are recorded and run as traces on a target device
    /// when values are needed.
    Lazy,
    /// The host program (`host`): where staged code runs Rust closures
    /// (`HostCall`). It runs CPU kernels on its own partition thread, so a
    /// host closure overlaps with the graph work that does not wait for it.
    Host,
    /// A device whose handler was registered by a library or the user (for
    /// example a logging wrapper).
    Custom,
}

/// A registered device. Devices live for the whole process.
pub struct DeviceInner {
    name: String,
    kind: DeviceKind,
    index: usize,
    handler: Arc<dyn OpHandler>,
}

/// A device: cheap to copy and compare (devices are interned, so equality
/// is identity).
#[derive(Clone, Copy)]
pub struct Device(&'static DeviceInner);

fn devices() -> &'static Mutex<Vec<&'static DeviceInner>> {
    static DEVICES: OnceLock<Mutex<Vec<&'static DeviceInner>>> = OnceLock::new();
    DEVICES.get_or_init(|| Mutex::new(Vec::new()))
}

fn intern(
    name: String,
    kind: DeviceKind,
    index: usize,
    make_handler: impl FnOnce() -> Arc<dyn OpHandler>,
    must_be_new: bool,
) -> Result<Device> {
    let mut all = devices().lock().unwrap_or_else(|p| p.into_inner());
    if let Some(existing) = all.iter().find(|d| d.name == name) {
        if must_be_new {
            return Err(Error::new(
                ErrorKind::Device,
                format!("a device named `{name}` is already registered"),
            ));
        }
        return Ok(Device(existing));
    }
    // Devices are few and live as long as the process: leaking them gives
    // `Device` a `&'static` that is `Copy` and compares by address.
    let inner: &'static DeviceInner = Box::leak(Box::new(DeviceInner {
        name,
        kind,
        index,
        handler: make_handler(),
    }));
    all.push(inner);
    Ok(Device(inner))
}

impl Device {
    /// The host CPU, `cpu:0`.
    pub fn cpu() -> Device {
        static CPU0: OnceLock<Device> = OnceLock::new();
        *CPU0.get_or_init(|| Device::cpu_n(0))
    }

    /// The host program's device, `host`. Staged code places `HostCall`
    /// nodes here; partitioning then joins them to the graph with
    /// Send/Recv pairs through the run's rendezvous.
    pub fn host() -> Device {
        static HOST: OnceLock<Device> = OnceLock::new();
        *HOST.get_or_init(|| {
            intern(
                "host".to_string(),
                DeviceKind::Host,
                0,
                || Arc::new(CpuOpHandler::new(0)),
                false,
            )
            .expect("interning the host device cannot fail")
        })
    }

    fn cpu_n(index: usize) -> Device {
        intern(
            format!("cpu:{index}"),
            DeviceKind::Cpu,
            index,
            || Arc::new(CpuOpHandler::new(index)),
            false,
        )
        .expect("interning an existing or new cpu device cannot fail")
    }

    /// Parses `cpu`, `cpu:0`, `cpu:1`, ... (`cpu:N` for N > 0 are virtual
    /// CPU devices), or the name of a registered custom device.
    pub fn parse(name: &str) -> Result<Device> {
        let name = name.trim();
        let (kind, index) = match name.split_once(':') {
            Some((kind, index)) => (kind, Some(index)),
            None => (name, None),
        };
        if let Some(target) = name.strip_prefix("lazy:") {
            return Ok(Device::lazy(&Device::parse(target)?));
        }
        if name == "host" {
            return Ok(Device::host());
        }
        if kind == "cpu" {
            let index = match index {
                None => 0,
                Some(text) => text.parse::<usize>().map_err(|_| {
                    Error::new(
                        ErrorKind::Device,
                        format!("bad device index in `{name}`: expected cpu:N with N = 0, 1, ..."),
                    )
                })?,
            };
            if index > 1024 {
                return Err(Error::new(
                    ErrorKind::Device,
                    format!("device index {index} in `{name}` is too large"),
                ));
            }
            return Ok(Device::cpu_n(index));
        }
        let all = devices().lock().unwrap_or_else(|p| p.into_inner());
        if let Some(existing) = all.iter().find(|d| d.name == name) {
            return Ok(Device(existing));
        }
        Err(Error::new(
            ErrorKind::Device,
            format!(
                "unknown device `{name}`: known kinds are `cpu:N` and registered devices ({})",
                all.iter()
                    .map(|d| d.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ))
    }

    /// The lazy device over `target`: ops on its tensors are recorded, not
    /// run, and materialized as one compiled trace on `target` when a value
    /// is needed or at [`crate::lazy::mark_step`].
    pub fn lazy(target: &Device) -> Device {
        let target = *target;
        intern(
            format!("lazy:{}", target.name()),
            DeviceKind::Lazy,
            target.index(),
            || Arc::new(crate::lazy::LazyOpHandler::new(target)),
            false,
        )
        .expect("interning an existing or new lazy device cannot fail")
    }

    /// For a lazy device, the device its traces run on.
    pub fn lazy_target(&self) -> Option<Device> {
        if self.kind() != DeviceKind::Lazy {
            return None;
        }
        Device::parse(self.name().strip_prefix("lazy:")?).ok()
    }

    /// Registers a device with its own op handler under a new name.
    pub fn register(name: &str, handler: Arc<dyn OpHandler>) -> Result<Device> {
        if name.starts_with("cpu") || name == "host" {
            return Err(Error::new(
                ErrorKind::Device,
                "`host` and device names starting with `cpu` are reserved",
            ));
        }
        intern(name.to_string(), DeviceKind::Custom, 0, || handler, true)
    }

    /// The device's name, e.g. `cpu:0`.
    pub fn name(&self) -> &'static str {
        &self.0.name
    }

    /// The device's kind.
    pub fn kind(&self) -> DeviceKind {
        self.0.kind
    }

    /// The index within its kind (`cpu:1` has index 1).
    pub fn index(&self) -> usize {
        self.0.index
    }

    /// The op handler that executes ops on this device.
    pub fn handler(&self) -> &'static dyn OpHandler {
        &*self.0.handler
    }
}

impl PartialEq for Device {
    fn eq(&self, other: &Device) -> bool {
        std::ptr::eq(self.0, other.0)
    }
}

impl Eq for Device {}

impl std::hash::Hash for Device {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (self.0 as *const DeviceInner).hash(state)
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.name)
    }
}

impl fmt::Debug for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Device({})", self.0.name)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_interns_devices() {
        assert_eq!(Device::parse("cpu").unwrap(), Device::cpu());
        assert_eq!(Device::parse("cpu:0").unwrap(), Device::cpu());
        let d1 = Device::parse("cpu:1").unwrap();
        assert_ne!(d1, Device::cpu());
        assert_eq!(d1, Device::parse(" cpu:1 ").unwrap());
        assert_eq!(d1.index(), 1);
        assert_eq!(d1.to_string(), "cpu:1");
        assert_eq!(Device::parse("host").unwrap(), Device::host());
        assert_eq!(Device::host().kind(), DeviceKind::Host);
        for bad in ["gpu:0", "cpu:x", "cpu:-1", "", "cpu:99999999999999999999"] {
            let err = Device::parse(bad).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::Device, "{bad}: {err}");
        }
    }
}
