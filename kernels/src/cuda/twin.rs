//! The CUDA backend's twin, for builds without the `cuda` feature: the same API, whose
//! constructor says this build has no CUDA. Its types are uninhabited, so every other method
//! is statically unreachable (`match self.never {}`) and callers compile unchanged.

use bulkhead_kvpool::Tag;

use super::{DeviceError, DeviceValue, KernelSource, StepSeq};
use crate::attention::{IntegrityError, KvLayout, TagCheck};
use crate::matmul::QMatrix;

/// No value of this type exists.
#[derive(Debug, Clone, Copy)]
enum Never {}

/// Always [`DeviceError::NotCompiledWithCuda`].
pub fn compile_ptx() -> Result<String, DeviceError> {
    Err(DeviceError::NotCompiledWithCuda)
}

/// A CUDA device; none can be opened in this build.
#[derive(Debug, Clone)]
pub struct CudaDevice {
    never: Never,
}

#[derive(Debug)]
pub struct CudaBuf<T: DeviceValue> {
    never: Never,
    _values: std::marker::PhantomData<T>,
}

impl<T: DeviceValue> CudaBuf<T> {
    pub fn len(&self) -> usize {
        match self.never {}
    }
    pub fn is_empty(&self) -> bool {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct DeviceMatrix {
    never: Never,
}

impl DeviceMatrix {
    pub fn rows(&self) -> usize {
        match self.never {}
    }
    pub fn cols(&self) -> usize {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct DeviceActs {
    never: Never,
}

impl DeviceActs {
    pub fn values(&self) -> &CudaBuf<f32> {
        match self.never {}
    }
    pub fn values_mut(&mut self) -> &mut CudaBuf<f32> {
        match self.never {}
    }
    pub fn rows(&self) -> usize {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct KvStep {
    never: Never,
}

impl KvStep {
    pub fn positions(&self) -> &CudaBuf<i32> {
        match self.never {}
    }
    pub fn tokens(&self) -> usize {
        match self.never {}
    }
}

#[derive(Debug)]
pub struct DeviceKv {
    never: Never,
}

impl CudaDevice {
    /// Always [`DeviceError::NotCompiledWithCuda`].
    pub fn open(_ordinal: usize, _source: &KernelSource) -> Result<CudaDevice, DeviceError> {
        Err(DeviceError::NotCompiledWithCuda)
    }
    pub fn name(&self) -> &str {
        match self.never {}
    }
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn upload<T: DeviceValue>(&self, _host: &[T]) -> Result<CudaBuf<T>, DeviceError> {
        match self.never {}
    }
    pub fn zeros<T: DeviceValue>(&self, _n: usize) -> Result<CudaBuf<T>, DeviceError> {
        match self.never {}
    }
    pub fn download<T: DeviceValue>(
        &self,
        _buf: &CudaBuf<T>,
        _n: usize,
    ) -> Result<Vec<T>, DeviceError> {
        match self.never {}
    }
    pub fn write<T: DeviceValue>(
        &self,
        _host: &[T],
        _dst: &mut CudaBuf<T>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn upload_matrix(&self, _w: &QMatrix<'_>) -> Result<DeviceMatrix, DeviceError> {
        match self.never {}
    }
    pub fn acts(&self, _rows: usize, _cols: usize) -> Result<DeviceActs, DeviceError> {
        match self.never {}
    }
    pub fn quantize(&self, _a: &mut DeviceActs) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn rms_norm(
        &self,
        _x: &CudaBuf<f32>,
        _w: &CudaBuf<f32>,
        _eps: f32,
        _rows: usize,
        _out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn rope(
        &self,
        _x: &mut CudaBuf<f32>,
        _rows: usize,
        _width: usize,
        _positions: &CudaBuf<i32>,
        _inv_freq: &CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn silu_mul(
        &self,
        _gate: &mut CudaBuf<f32>,
        _up: &CudaBuf<f32>,
        _n: usize,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn add_assign(
        &self,
        _a: &mut CudaBuf<f32>,
        _b: &CudaBuf<f32>,
        _n: usize,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn matmul(
        &self,
        _w: &DeviceMatrix,
        _x: &DeviceActs,
        _out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn get_rows(
        &self,
        _w: &DeviceMatrix,
        _ids: &CudaBuf<u32>,
        _n: usize,
        _out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn gather_rows(
        &self,
        _src: &CudaBuf<f32>,
        _width: usize,
        _ids: &CudaBuf<u32>,
        _n: usize,
        _out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn kv_pool(&self, _layout: KvLayout, _pages: usize) -> Result<DeviceKv, DeviceError> {
        match self.never {}
    }
    pub fn kv_step(
        &self,
        _layout: &KvLayout,
        _tags: &[Tag],
        _check: TagCheck,
        _canary: bool,
        _seqs: &[StepSeq<'_>],
    ) -> Result<KvStep, DeviceError> {
        match self.never {}
    }
    pub fn step_failures(
        &self,
        _step: &KvStep,
    ) -> Result<Vec<Option<IntegrityError>>, DeviceError> {
        match self.never {}
    }
    pub fn write_kv(
        &self,
        _kv: &mut DeviceKv,
        _step: &mut KvStep,
        _layer: usize,
        _k: &CudaBuf<f32>,
        _v: &CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn attend(
        &self,
        _kv: &mut DeviceKv,
        _step: &mut KvStep,
        _layer: usize,
        _q: &CudaBuf<f32>,
        _heads: usize,
        _out: &mut CudaBuf<f32>,
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
}

impl DeviceKv {
    pub fn layout(&self) -> &KvLayout {
        match self.never {}
    }
    pub fn pages(&self) -> usize {
        match self.never {}
    }
    pub fn fill(&mut self, _start: usize, _n: usize, _bits: u16) -> Result<(), DeviceError> {
        match self.never {}
    }
    pub fn read_runs(
        &self,
        _start: usize,
        _runs: usize,
        _stride: usize,
        _width: usize,
    ) -> Result<Vec<u16>, DeviceError> {
        match self.never {}
    }
    pub fn write_runs(
        &mut self,
        _start: usize,
        _stride: usize,
        _width: usize,
        _values: &[u16],
    ) -> Result<(), DeviceError> {
        match self.never {}
    }
}
