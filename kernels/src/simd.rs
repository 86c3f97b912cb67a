//! Which SIMD level the kernels use, chosen once at run time from the CPU's features.

use std::sync::OnceLock;

/// A kernel implementation level, only ever one the running CPU supports: the vector levels
/// are obtained only through detection ([`Simd::available`], [`Simd::best`],
/// [`Simd::by_name`]), which is what makes the kernels' calls into them sound. Outside the
/// kernels none can be built by hand:
///
/// ```compile_fail
/// let avx512 = bulkhead_kernels::Simd(Default::default());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Simd(Level);

/// The levels, private to the kernels: matched on, never built outside detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Level {
    /// Plain Rust, any CPU: the reference every other level is tested against.
    Portable,
    /// x86-64 AVX2 + FMA (+ F16C).
    #[cfg(target_arch = "x86_64")]
    Avx2,
    /// x86-64 AVX-512 F/BW/VL with VNNI (8-bit dot products), on top of AVX2.
    #[cfg(target_arch = "x86_64")]
    Avx512,
}

impl Simd {
    /// Plain Rust: every CPU has it.
    pub const PORTABLE: Simd = Simd(Level::Portable);

    /// The level, for the kernels to dispatch on.
    pub(crate) fn level(self) -> Level {
        self.0
    }

    /// The best level this CPU supports (detected once).
    pub fn best() -> Simd {
        static BEST: OnceLock<Simd> = OnceLock::new();
        *BEST.get_or_init(|| Simd::available().last().copied().unwrap_or(Simd::PORTABLE))
    }

    /// Every level this CPU supports, portable first.
    pub fn available() -> Vec<Simd> {
        let mut levels = vec![Simd::PORTABLE];
        #[cfg(target_arch = "x86_64")]
        if is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c")
        {
            levels.push(Simd(Level::Avx2));
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vl")
                && is_x86_feature_detected!("avx512vnni")
            {
                levels.push(Simd(Level::Avx512));
            }
        }
        levels
    }

    /// The level named `name` (`portable`, `avx2`, `avx512`) if this CPU supports it.
    pub fn by_name(name: &str) -> Option<Simd> {
        Simd::available().into_iter().find(|s| s.name() == name)
    }

    pub fn name(self) -> &'static str {
        match self.0 {
            Level::Portable => "portable",
            #[cfg(target_arch = "x86_64")]
            Level::Avx2 => "avx2",
            #[cfg(target_arch = "x86_64")]
            Level::Avx512 => "avx512",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every vector level comes from detection, and detection names each one it finds.
    #[test]
    fn each_level_available_is_named_and_found_by_its_name() {
        let levels = Simd::available();
        assert_eq!(levels[0], Simd::PORTABLE);
        for simd in levels {
            assert_eq!(Simd::by_name(simd.name()), Some(simd));
        }
        assert_eq!(Simd::by_name("avx1024"), None);
    }
}
