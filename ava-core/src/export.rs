//! [`export_plugin!`](crate::export_plugin): the few lines of glue that turn a crate into an
//! Ava plugin library.

/// Exports a plugin type from a `cdylib` crate.
///
/// ```ignore
/// ava_core::export_plugin!(optimizer: Lion);
/// ```
///
/// The kind is one of `optimizer`, `attention`, `checkpoint`, `offload`, `memory`, and the
/// type must implement [`Plugin`](crate::Plugin) and the matching trait. The macro defines
/// the library's abi_stable header (the only exported symbol); the host reads the manifest
/// through it and calls the constructor of the kind it asks for. Every call through it runs
/// under `catch_unwind`, so build plugins with the default `panic = "unwind"`.
#[macro_export]
macro_rules! export_plugin {
    ($kind:ident : $ty:ty) => {
        /// The abi_stable library header of this Ava plugin.
        #[doc(hidden)]
        #[unsafe(export_name = "_1as_0lib_1header_0root_bmodule_bloader")]
        pub static __AVA_PLUGIN_LIB_HEADER: $crate::__private::abi_stable::library::LibHeader = {
            extern "C" fn __ava_root_module() -> $crate::__private::abi_stable::library::RootModuleResult {
                $crate::__private::abi_stable::library::__call_root_module_loader(|| -> $crate::ffi::PluginRootRef {
                    $crate::ffi::PluginRoot::$kind::<$ty>()
                })
            }
            // SAFETY: the constructor returns a `PluginRootRef`, the module type named here.
            unsafe {
                $crate::__private::abi_stable::library::LibHeader::from_constructor::<$crate::ffi::PluginRootRef>(
                    __ava_root_module,
                    $crate::__private::abi_stable::library::CheckTypeLayout::Yes,
                )
            }
        };
    };
}
