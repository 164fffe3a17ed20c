/* optamp/c_api.h from C: compiled as C11 with -Wall -Wextra -Werror -pedantic (no C++ in the
 * header), linked against liboptamp by a C compiler and run as a ctest
 * (packaging.c_api_compiles_and_links_as_c11). It takes the address of every function the header
 * declares and calls the ones that need no tensors. */
#include <stdio.h>
#include <string.h>

#include "optamp/c_api.h"

typedef void (*any_function)(void);

/* Every function of the header: a missing or C++-mangled export fails the link. */
static const any_function kEveryFunction[] = {
    (any_function)optamp_last_error,
    (any_function)optamp_status_name,
    (any_function)optamp_abi_version,
    (any_function)optamp_initialize,
    (any_function)optamp_resolve,
    (any_function)optamp_reset,
    (any_function)optamp_is_initialized,
    (any_function)optamp_model_boundary,
    (any_function)optamp_cast_model_output,
    (any_function)optamp_autocast_enter,
    (any_function)optamp_autocast_exit,
    (any_function)optamp_disable_casts_enter,
    (any_function)optamp_disable_casts_exit,
    (any_function)optamp_scale_loss_begin,
    (any_function)optamp_scale_loss_finish,
    (any_function)optamp_scale_loss_abandon,
    (any_function)optamp_step_should_skip,
    (any_function)optamp_loss_scale,
    (any_function)optamp_state_save,
    (any_function)optamp_state_load,
    (any_function)optamp_buffer_free,
    (any_function)optamp_tensor_free,
};

static int failures = 0;

static void expect(int ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "c_api_compile: FAILED: %s (last error: \"%s\")\n", what, optamp_last_error());
    ++failures;
  }
}

int main(void) {
  size_t i;
  for (i = 0; i < sizeof kEveryFunction / sizeof kEveryFunction[0]; ++i) {
    expect(kEveryFunction[i] != NULL, "every function has an address");
  }
  expect(optamp_abi_version() == OPTAMP_ABI_VERSION, "optamp_abi_version() == OPTAMP_ABI_VERSION");
  expect(strcmp(optamp_status_name(OPTAMP_ERROR_VALUE), "OPTAMP_ERROR_VALUE") == 0,
         "optamp_status_name names the status");
  expect(optamp_is_initialized() == 0, "not initialized at start");

  {
    const char* keys[] = {"loss_scale", "keep_batchnorm_fp32"};
    const char* values[] = {"128.0", "True"};
    optamp_properties props;
    memset(&props, 0, sizeof props);
    props.struct_size = sizeof props;
    expect(optamp_resolve("O2", keys, values, 2, &props) == OPTAMP_OK, "resolve O2 succeeds");
    expect(strcmp(optamp_last_error(), "") == 0, "no message after a success");
    expect(props.opt_level == 2 && props.loss_scale_dynamic == 0 && props.loss_scale == 128.0,
           "O2 with loss_scale 128.0");
    expect(props.low_dtype == OPTAMP_DTYPE_FLOAT16 && props.model_cast == 1 &&
               props.keep_batchnorm_fp32 == 1 && props.master_weights == 1,
           "O2's properties");
    expect(optamp_resolve("O9", NULL, NULL, 0, &props) == OPTAMP_ERROR_VALUE, "O9 is refused");
    expect(strstr(optamp_last_error(), "opt_level") != NULL, "the message names opt_level");
    expect(optamp_resolve(NULL, NULL, NULL, 0, &props) == OPTAMP_ERROR_NULL_ARGUMENT,
           "a NULL opt_level is refused");
  }
  {
    optamp_region* region = NULL;
    expect(optamp_autocast_enter(1, OPTAMP_DTYPE_BFLOAT16, &region) == OPTAMP_OK && region,
           "a bf16 region opens");
    expect(optamp_autocast_exit(region) == OPTAMP_OK, "and ends");
    expect(optamp_disable_casts_enter(&region) == OPTAMP_OK && region, "disable_casts opens");
    expect(optamp_disable_casts_exit(region) == OPTAMP_OK, "and ends");
  }
  optamp_buffer_free(NULL);
  optamp_tensor_free(NULL);
  if (failures == 0) printf("c_api_compile: ok\n");
  return failures == 0 ? 0 : 1;
}
