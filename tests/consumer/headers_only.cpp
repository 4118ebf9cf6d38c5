// Compiled with <prefix>/include as the only cudp include root: the installed headers name each
// other as <cudp/...>, and the library's folders are not on the path under generic names.
#include <cudp/cudp.h>

#if __has_include(<data/loader.h>) || __has_include(<layers/module.h>)
#error "a generic data/loader.h or layers/module.h is on the include path"
#endif
#if !__has_include(<cudp/layers/module.h>)
#error "cudp/layers/module.h is not installed"
#endif
