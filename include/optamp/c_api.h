/* optamp's stable C ABI: Apex-style mixed precision for every binding over LibTorch.
 *
 * A binding (tch-rs, TorchSharp, R torch, javacpp, ...) already passes `at::Tensor*` through its
 * own C shim; this header takes those same pointers and drives optamp's tensor-level core
 * (optamp/core.h): initialize from the model's and optimizers' tensors, autocast regions, the
 * scale_loss guard around backward, the step's skip decision, the loss scalers' state as bytes.
 * Plain C (C11 and C++), opaque handles, no exception ever crosses it: every function that can
 * fail returns an optamp_status and leaves a message for the calling thread (optamp_last_error).
 * docs/c_api.md holds the lifetime and threading rules and a sketch of a binding.
 *
 * Versioning: OPTAMP_ABI_VERSION changes only on an incompatible change; optamp_abi_version()
 * says which one the loaded library implements. The structs start with `struct_size` (set it to
 * sizeof the struct as your header declares it): fields appended in later versions are read or
 * written only when they lie within struct_size, so an older caller keeps working. */
#pragma once

#include <stddef.h>
#include <stdint.h>

#if defined(_WIN32)
#if defined(OPTAMP_BUILDING_LIBRARY)
#define OPTAMP_C_API __declspec(dllexport)
#else
#define OPTAMP_C_API __declspec(dllimport)
#endif
#else
#define OPTAMP_C_API __attribute__((visibility("default")))
#endif

#define OPTAMP_ABI_VERSION 1

#ifdef __cplusplus
extern "C" {
#endif

/* ---- handles -------------------------------------------------------------------------------- */

/* IS an `at::Tensor`: pass your binding's `at::Tensor*` cast to `optamp_tensor*`. optamp never
 * takes ownership of a tensor you pass; the tensors it creates (the scaled loss) are new heap
 * `at::Tensor`s you free with optamp_tensor_free (or your binding's own `delete (at::Tensor*)`). */
typedef struct optamp_tensor optamp_tensor;
/* An open autocast or disable_casts region (optamp_autocast_enter, optamp_disable_casts_enter). */
typedef struct optamp_region optamp_region;
/* A live scale_loss guard (optamp_scale_loss_begin): finish or abandon it exactly once. */
typedef struct optamp_scaled_loss optamp_scaled_loss;

/* ---- status and errors ---------------------------------------------------------------------- */

typedef enum optamp_status {
  OPTAMP_OK = 0,
  OPTAMP_ERROR_VALUE = 1,         /* a bad value or option (Python's ValueError) */
  OPTAMP_ERROR_TYPE = 2,          /* a value of the wrong kind (TypeError) */
  OPTAMP_ERROR_INDEX = 3,         /* an index out of range (IndexError) */
  OPTAMP_ERROR_RUNTIME = 4,       /* any other failure (RuntimeError) */
  OPTAMP_ERROR_NULL_ARGUMENT = 5, /* a required pointer was NULL */
  /* Not a status. It makes every int a valid optamp_status in C++ (where a value beyond the
     named ones is otherwise undefined: optamp_status_name takes any); keeps it int-sized. */
  OPTAMP_STATUS_MAX_ENUM = 0x7FFFFFFF
} optamp_status;

/* This thread's message of its last failing call, or "" after a successful one (or none yet).
 * The pointer is valid until this thread calls optamp again: copy the text first. */
OPTAMP_C_API const char* optamp_last_error(void);
/* "OPTAMP_OK", "OPTAMP_ERROR_VALUE", ...; "OPTAMP_ERROR_UNKNOWN" for another value. Static. */
OPTAMP_C_API const char* optamp_status_name(optamp_status status);

/* OPTAMP_ABI_VERSION of the loaded library. */
OPTAMP_C_API uint32_t optamp_abi_version(void);

/* ---- dtypes and properties ------------------------------------------------------------------ */

typedef enum optamp_dtype {
  OPTAMP_DTYPE_UNDEFINED = 0, /* None */
  OPTAMP_DTYPE_FLOAT32 = 1,
  OPTAMP_DTYPE_FLOAT16 = 2,
  OPTAMP_DTYPE_BFLOAT16 = 3,
  OPTAMP_DTYPE_FLOAT64 = 4,
  /* Not a dtype (refused as one). It makes every int a valid optamp_dtype in C++, so that a value
     the library does not name is refused with OPTAMP_ERROR_VALUE, and keeps it int-sized. */
  OPTAMP_DTYPE_MAX_ENUM = 0x7FFFFFFF
} optamp_dtype;

/* What a level resolved to (amp::Properties). Flags are 0/1; the optional flags are -1 for None. */
typedef struct optamp_properties {
  size_t struct_size; /* in: sizeof(optamp_properties) */
  int opt_level;      /* 0..5 for O0..O5 */
  int enabled;
  int loss_scale_dynamic; /* 1: "dynamic" */
  double loss_scale;      /* the fixed scale (1.0 when dynamic) */
  int low_dtype;          /* optamp_dtype the level casts to; UNDEFINED when it casts nothing */
  int num_losses;
  int casts;                 /* whether initialize turns casting on at all */
  int model_cast;            /* 0 none, 1 fp32 masters + working copies (O2/O5), 2 in place (O3) */
  int cast_model_type;       /* optamp_dtype; UNDEFINED = None */
  int keep_batchnorm_fp32;   /* -1 None, 0, 1: whether batch-norm tensors go to keep_fp32 */
  int master_weights;        /* -1 None, 0, 1 */
  int patch_torch_functions; /* 0/1 */
} optamp_properties;

/* ---- initialize ----------------------------------------------------------------------------- */

/* The model(s) as tensors (amp::core::ModelTensors), in the order your front collects them (the
 * LibTorch front: each module's own parameters, then its floating buffers, then its children,
 * depth first). An array may be NULL when its count is 0. */
typedef struct optamp_model_tensors {
  size_t struct_size;            /* sizeof(optamp_model_tensors) */
  optamp_tensor* const* reduced; /* seen as working copies (O2/O5) or cast (O3) */
  size_t num_reduced;
  optamp_tensor* const* keep_fp32; /* batch-norm / keep-in-fp32 modules' tensors */
  size_t num_keep_fp32;
  /* every parameter, for the optimizer checks; the `reduced` tensors not among them are
   * buffers, whose views O2/O5 hand their own data */
  optamp_tensor* const* parameters;
  size_t num_parameters;
  const char* const* parameter_names; /* NULL, or num_parameters names ("fc1.weight") */
  const void* const* identities;      /* the model objects (optamp_model_boundary); optional */
  size_t num_identities;
} optamp_model_tensors;

/* One optimizer as tensors (amp::core::OptimizerTensors). */
typedef struct optamp_optimizer_tensors {
  size_t struct_size;               /* sizeof(optamp_optimizer_tensors) */
  const void* identity;             /* your optimizer object: scale_loss_begin names it again */
  const char* description;          /* for messages, e.g. "optimizer 0 (Adam)"; NULL: generic */
  optamp_tensor* const* parameters; /* in param-group order */
  size_t num_parameters;
  optamp_tensor* const* state;        /* its state tensors (device check), may be NULL */
  optamp_tensor* const* state_owners; /* state_owners[i]: the parameter state[i] belongs to */
  size_t num_state;
  double smallest_eps;       /* its smallest epsilon (O3 fp16 warning); 0 = none */
  int steps_through_closure; /* 1: LBFGS-like, refused */
} optamp_optimizer_tensors;

/* Options are key/value strings with Apex's names and Python's spellings: enabled,
 * cast_model_type, patch_torch_functions, patch_torch_functions_type, keep_batchnorm_fp32,
 * master_weights, loss_scale, num_losses, min_loss_scale, max_loss_scale, verbosity, init_scale,
 * growth_factor, backoff_factor, growth_interval, hysteresis, overflow_check,
 * rules_under_no_grad, op_lists, cast_model_outputs, cast_model_inputs. Booleans "True"/
 * "False"/"true"/"false"/"1"/"0"; numbers as strtod/decimal integers; loss_scale "dynamic" or a
 * number; dtypes "float16"/"half", "bfloat16", "float32"/"float", "float64"/"double" (also
 * "torch.float16"...); "None" for cast_model_type and patch_torch_functions_type is C++'s Undefined
 * (cast_model_type also takes "False"); a NULL value means "not overridden". Unknown keys are
 * OPTAMP_ERROR_VALUE.
 *
 * Validates everything first (on error nothing changes), then initializes amp for the process
 * and turns casting on for the calling thread. `out` may be NULL. */
OPTAMP_C_API optamp_status optamp_initialize(const optamp_model_tensors* model,
                                             const optamp_optimizer_tensors* optimizers,
                                             size_t num_optimizers, const char* opt_level,
                                             const char* const* option_keys,
                                             const char* const* option_values, size_t num_options,
                                             optamp_properties* out);
/* The level's properties with these options, validated, without initializing (for example to
 * learn keep_batchnorm_fp32 before splitting the model's tensors). */
OPTAMP_C_API optamp_status optamp_resolve(const char* opt_level, const char* const* option_keys,
                                          const char* const* option_values, size_t num_options,
                                          optamp_properties* out);
/* amp::reset: casting off on every thread, regions ended, loss scalers dropped. */
OPTAMP_C_API optamp_status optamp_reset(void);
/* 1 when initialized (since the last reset), else 0. */
OPTAMP_C_API int optamp_is_initialized(void);
/* The casts at the boundary of `model` (one of the identities given to initialize; NULL: any)
 * for a forward on this thread now, Apex's patched forward: cast floating inputs to *inputs_out
 * and floating outputs to *outputs_out; UNDEFINED leaves them. Both UNDEFINED when not
 * initialized or for another model. */
OPTAMP_C_API optamp_status optamp_model_boundary(const void* model, optamp_dtype* inputs_out,
                                                 optamp_dtype* outputs_out);
/* A floating output of an initialized model cast to `dtype` (the boundary's outputs dtype;
 * UNDEFINED, or a non-floating output: the same tensor), as the fronts' boundaries cast them:
 * at O2/O5 the reduced output stays with its fp32 cast, so that cross_entropy of the fp32
 * logits reads the reduced ones. *out: a new tensor handle (optamp_tensor_free). */
OPTAMP_C_API optamp_status optamp_cast_model_output(const optamp_tensor* output, optamp_dtype dtype,
                                                    optamp_tensor** out);

/* ---- regions -------------------------------------------------------------------------------- */

/* amp::autocast on this thread: enabled=1 casts to `dtype` (FLOAT16 or BFLOAT16; UNDEFINED: the
 * initialized level's, or float16), enabled=0 turns the rules off inside. Also under no_grad.
 * Nestable; regions may end in any order and on any thread (docs/c_api.md). */
OPTAMP_C_API optamp_status optamp_autocast_enter(int enabled, optamp_dtype dtype,
                                                 optamp_region** out);
/* Ends a region of optamp_autocast_enter and frees it. */
OPTAMP_C_API optamp_status optamp_autocast_exit(optamp_region* region);
/* amp::disable_casts (Apex's amp.disable_casts()): no casting rules on this thread inside. */
OPTAMP_C_API optamp_status optamp_disable_casts_enter(optamp_region** out);
/* Ends a region of optamp_disable_casts_enter and frees it. */
OPTAMP_C_API optamp_status optamp_disable_casts_exit(optamp_region* region);

/* ---- scale_loss and the step ---------------------------------------------------------------- */

/* Opens a scale_loss guard (Apex's `with amp.scale_loss(loss, optimizers) as scaled_loss`) over
 * `params` (every parameter of the optimizers, in their order). optimizer_identities (may be
 * NULL when num_optimizers is 0) are checked against those given to initialize. On success
 * *guard_out is the guard and *scaled_out a new tensor, loss.float() * scale: call backward on
 * it yourself, then optamp_scale_loss_finish. On error both are set to NULL. */
OPTAMP_C_API optamp_status optamp_scale_loss_begin(
    const optamp_tensor* loss, const void* const* optimizer_identities, size_t num_optimizers,
    optamp_tensor* const* params, size_t num_params, int loss_id, int delay_unscale,
    optamp_scaled_loss** guard_out, optamp_tensor** scaled_out);
/* Ends the guard: unscales the gradients in one fused pass, checks them for inf/NaN and updates
 * the scale (nothing with delay_unscale). *skipped_out (may be NULL) is 1 when this step
 * overflowed: its gradients were reset. Frees the guard, also on error; on error *skipped_out
 * is 1 (do not step). An error too when a trainable parameter changed in place since begin (the
 * optimizer stepped between begin and finish, with scaled gradients). */
OPTAMP_C_API optamp_status optamp_scale_loss_finish(optamp_scaled_loss* guard, int* skipped_out);
/* Ends the guard on an error path (an exception in your backward): nothing is checked, gradients
 * that appeared inside the guard are dropped, earlier micro-batches' gradients are divided by the
 * scale again (with what the interrupted backward added), delayed ones stay scaled. Frees the
 * guard. */
OPTAMP_C_API optamp_status optamp_scale_loss_abandon(optamp_scaled_loss* guard);
/* amp::step's decision for the parameters of the optimizer(s) you are about to step: *skip_out
 * is 1 when a guard over any of them overflowed since the last call (their gradients are then
 * reset; do not call the optimizer's step), else 0 (step). Refuses (nothing changed) while a
 * parameter still holds scaled gradients (the last guard used delay_unscale). */
OPTAMP_C_API optamp_status optamp_step_should_skip(optamp_tensor* const* params, size_t num_params,
                                                   int* skip_out);
/* The current loss scale of loss `loss_id`. */
OPTAMP_C_API optamp_status optamp_loss_scale(int loss_id, double* out);

/* ---- state ---------------------------------------------------------------------------------- */

/* amp::state_dict() as bytes (torch's pickle format: torch.load reads it as a dict of tensors).
 * *data_out is malloc'ed memory the caller frees with optamp_buffer_free. */
OPTAMP_C_API optamp_status optamp_state_save(uint8_t** data_out, size_t* size_out);
/* amp::load_state_dict of bytes from optamp_state_save (validated first: on error nothing
 * changes). Round trips are bit-exact. */
OPTAMP_C_API optamp_status optamp_state_load(const uint8_t* data, size_t size);
/* Frees a buffer of optamp_state_save; NULL is a no-op. */
OPTAMP_C_API void optamp_buffer_free(uint8_t* data);
/* Frees a tensor optamp created (the scaled loss); NULL is a no-op. */
OPTAMP_C_API void optamp_tensor_free(optamp_tensor* tensor);

#ifdef __cplusplus
} /* extern "C" */
#endif
