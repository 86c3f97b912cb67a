//! Which SIMD level the kernels use, chosen once at run time from the CPU's features.

use std::sync::OnceLock;

/// A kernel implementation level. Only levels the running CPU supports can be obtained.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    /// Plain Rust, any CPU: the reference every other level is tested against.
    Portable,
    /// x86-64 AVX2 + FMA (+ F16C).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with VNNI (8-bit dot products), on top of [`Simd::Avx2`].
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// The best level this CPU supports (detected once).
    pub fn best() -> Simd {
        static BEST: OnceLock<Simd> = OnceLock::new();
        *BEST.get_or_init(|| Simd::available().last().copied().unwrap_or(Simd::Portable))
    }

    /// Every level this CPU supports, portable first.
    pub fn available() -> Vec<Simd> {
        let mut levels = vec![Simd::Portable];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            levels.push(Simd::Avx2);
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                levels.push(Simd::Avx512);
            }
        }
        levels
    }

    /// The level named `name` (`portable`, `avx2`, `avx512`) if this CPU supports it.
    pub fn by_name(name: &str) -> Option<Simd> {
        Simd::available().into_iter().find(|s| s.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self {
            Simd::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Simd::Avx512 => "avx512",
        }
    }
}
