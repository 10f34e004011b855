# cython: language_level=3
# Extern declarations for ggml.h (only what toy binds). No logic here.
from libc.stdint cimport int32_t, int64_t, uint8_t, uint16_t

cdef extern from "ggml.h" nogil:
    enum:
        GGML_MAX_DIMS
        GGML_MAX_SRC
        GGML_MAX_NAME
        GGML_MAX_OP_PARAMS
        GGML_DEFAULT_GRAPH_SIZE
        GGML_ROPE_TYPE_NEOX

    ctypedef uint16_t ggml_fp16_t

    cdef enum ggml_status:
        GGML_STATUS_ALLOC_FAILED
        GGML_STATUS_FAILED
        GGML_STATUS_SUCCESS
        GGML_STATUS_ABORTED

    cdef enum ggml_type:
        GGML_TYPE_F32
        GGML_TYPE_F16
        GGML_TYPE_I32
        GGML_TYPE_I64
        GGML_TYPE_COUNT

    cdef enum ggml_op:
        GGML_OP_NONE
        GGML_OP_UNARY
        GGML_OP_GLU
        GGML_OP_COUNT

    cdef enum ggml_unary_op:
        GGML_UNARY_OP_NEG
        GGML_UNARY_OP_TANH
        GGML_UNARY_OP_SIGMOID
        GGML_UNARY_OP_GELU
        GGML_UNARY_OP_SILU
        GGML_UNARY_OP_EXP
        GGML_UNARY_OP_RELU
        GGML_UNARY_OP_COUNT

    cdef enum ggml_glu_op:
        GGML_GLU_OP_SWIGLU
        GGML_GLU_OP_COUNT

    cdef enum ggml_log_level:
        GGML_LOG_LEVEL_NONE
        GGML_LOG_LEVEL_DEBUG
        GGML_LOG_LEVEL_INFO
        GGML_LOG_LEVEL_WARN
        GGML_LOG_LEVEL_ERROR
        GGML_LOG_LEVEL_CONT

    cdef enum ggml_tensor_flag:
        GGML_TENSOR_FLAG_INPUT
        GGML_TENSOR_FLAG_OUTPUT
        GGML_TENSOR_FLAG_PARAM
        GGML_TENSOR_FLAG_LOSS

    cdef enum ggml_op_pool:
        GGML_OP_POOL_MAX
        GGML_OP_POOL_AVG

    cdef enum ggml_sort_order:
        GGML_SORT_ORDER_ASC
        GGML_SORT_ORDER_DESC

    struct ggml_context:
        pass

    struct ggml_backend_buffer:
        pass

    struct ggml_init_params:
        size_t mem_size
        void * mem_buffer
        bint no_alloc

    struct ggml_tensor:
        ggml_type type
        ggml_backend_buffer * buffer
        int64_t ne[4]
        size_t nb[4]
        ggml_op op
        int32_t op_params[16]
        int32_t flags
        ggml_tensor * src[10]
        ggml_tensor * view_src
        size_t view_offs
        void * data
        char name[64]
        void * extra

    struct ggml_cgraph:
        pass

    ctypedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k) noexcept nogil
    ctypedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k) noexcept nogil

    struct ggml_type_traits:
        const char * type_name
        int64_t blck_size
        int64_t blck_size_interleave
        size_t type_size
        bint is_quantized
        ggml_to_float_t to_float
        ggml_from_float_t from_float_ref

    ctypedef void (*ggml_log_callback)(ggml_log_level level, const char * text, void * user_data) noexcept

    const char * ggml_status_to_string(ggml_status status)
    const char * ggml_version()
    const char * ggml_commit()

    # types and introspection
    int64_t ggml_blck_size(ggml_type type)
    size_t ggml_type_size(ggml_type type)
    size_t ggml_row_size(ggml_type type, int64_t ne)
    const char * ggml_type_name(ggml_type type)
    const char * ggml_op_name(ggml_op op)
    const char * ggml_op_symbol(ggml_op op)
    const char * ggml_unary_op_name(ggml_unary_op op)
    const char * ggml_glu_op_name(ggml_glu_op op)
    bint ggml_is_quantized(ggml_type type)
    const ggml_type_traits * ggml_get_type_traits(ggml_type type)
    int64_t ggml_nelements(const ggml_tensor * tensor)
    int64_t ggml_nrows(const ggml_tensor * tensor)
    size_t ggml_nbytes(const ggml_tensor * tensor)
    int ggml_n_dims(const ggml_tensor * tensor)
    bint ggml_is_contiguous(const ggml_tensor * tensor)
    bint ggml_is_contiguous_1(const ggml_tensor * tensor)
    bint ggml_is_contiguous_rows(const ggml_tensor * tensor)
    bint ggml_is_vector(const ggml_tensor * tensor)
    bint ggml_is_matrix(const ggml_tensor * tensor)
    bint ggml_is_transposed(const ggml_tensor * tensor)
    bint ggml_is_permuted(const ggml_tensor * tensor)
    bint ggml_are_same_shape(const ggml_tensor * t0, const ggml_tensor * t1)
    size_t ggml_tensor_overhead()
    size_t ggml_graph_overhead_custom(size_t size, bint grads)
    bint ggml_validate_row_data(ggml_type type, const void * data, size_t nbytes)
    ggml_unary_op ggml_get_unary_op(const ggml_tensor * tensor)
    ggml_glu_op ggml_get_glu_op(const ggml_tensor * tensor)

    # contexts
    ggml_context * ggml_init(ggml_init_params params)
    void ggml_free(ggml_context * ctx)
    size_t ggml_used_mem(const ggml_context * ctx)
    bint ggml_get_no_alloc(ggml_context * ctx)
    size_t ggml_get_mem_size(const ggml_context * ctx)

    ggml_tensor * ggml_new_tensor(ggml_context * ctx, ggml_type type, int n_dims, const int64_t * ne)
    ggml_tensor * ggml_get_first_tensor(const ggml_context * ctx)
    ggml_tensor * ggml_get_next_tensor(const ggml_context * ctx, ggml_tensor * tensor)
    ggml_tensor * ggml_get_tensor(ggml_context * ctx, const char * name)
    const char * ggml_get_name(const ggml_tensor * tensor)
    const char * ggml_op_desc(const ggml_tensor * t)
    ggml_tensor * ggml_set_name(ggml_tensor * tensor, const char * name)
    void ggml_set_input(ggml_tensor * tensor)
    void ggml_set_output(ggml_tensor * tensor)
    void ggml_set_param(ggml_tensor * tensor)
    void ggml_set_loss(ggml_tensor * tensor)

    # ops
    ggml_tensor * ggml_dup(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_add(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_sub(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_mul(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_div(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_sqr(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sqrt(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_log(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_exp(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_neg(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_relu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sum(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sum_sqr(ggml_context * ctx, ggml_tensor * a)  # toy patch 0017
    ggml_tensor * ggml_sum_rows(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_mean(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_argmax(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_top_k(ggml_context * ctx, ggml_tensor * a, int k)
    ggml_tensor * ggml_argsort_top_k(ggml_context * ctx, ggml_tensor * a, int k)
    ggml_tensor * ggml_repeat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_repeat_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)
    ggml_tensor * ggml_concat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int dim)
    ggml_tensor * ggml_tanh(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_sigmoid(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_gelu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_gelu_erf(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_erf(ggml_context * ctx, ggml_tensor * a)  # toy patch 0010
    ggml_tensor * ggml_silu(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_swiglu_split(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_norm(ggml_context * ctx, ggml_tensor * a, float eps)
    ggml_tensor * ggml_rms_norm(ggml_context * ctx, ggml_tensor * a, float eps)
    ggml_tensor * ggml_mul_mat(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    # toy patch 0011
    ggml_tensor * ggml_mul_mat_toy_gemm(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    bint ggml_toy_gemm_operand_ok(const ggml_tensor * t)
    bint ggml_toy_gemm_quant_t_ok(const ggml_tensor * t)  # toy patch 0018
    ggml_tensor * ggml_mul_mat_id(ggml_context * ctx, ggml_tensor * as_, ggml_tensor * b, ggml_tensor * ids)
    ggml_tensor * ggml_out_prod(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_scale(ggml_context * ctx, ggml_tensor * a, float s)
    ggml_tensor * ggml_scale_bias(ggml_context * ctx, ggml_tensor * a, float s, float b)
    ggml_tensor * ggml_cpy(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_cast(ggml_context * ctx, ggml_tensor * a, ggml_type type)
    ggml_tensor * ggml_cont(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_reshape_1d(ggml_context * ctx, ggml_tensor * a, int64_t ne0)
    ggml_tensor * ggml_reshape_2d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1)
    ggml_tensor * ggml_reshape_3d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2)
    ggml_tensor * ggml_reshape_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3)
    ggml_tensor * ggml_view_4d(ggml_context * ctx, ggml_tensor * a, int64_t ne0, int64_t ne1, int64_t ne2, int64_t ne3, size_t nb1, size_t nb2, size_t nb3, size_t offset)
    ggml_tensor * ggml_permute(ggml_context * ctx, ggml_tensor * a, int axis0, int axis1, int axis2, int axis3)
    ggml_tensor * ggml_transpose(ggml_context * ctx, ggml_tensor * a)
    ggml_tensor * ggml_get_rows(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_set_rows(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c)
    ggml_tensor * ggml_diag_mask_inf(ggml_context * ctx, ggml_tensor * a, int n_past)
    ggml_tensor * ggml_clamp(ggml_context * ctx, ggml_tensor * a, float min, float max)
    ggml_tensor * ggml_soft_max_ext(ggml_context * ctx, ggml_tensor * a, ggml_tensor * mask, float scale, float max_bias)
    ggml_tensor * ggml_rope_ext(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, ggml_tensor * c, int n_dims, int mode, int n_ctx_orig, float freq_base, float freq_scale, float ext_factor, float attn_factor, float beta_fast, float beta_slow)
    ggml_tensor * ggml_pad_ext(ggml_context * ctx, ggml_tensor * a, int lp0, int rp0, int lp1, int rp1, int lp2, int rp2, int lp3, int rp3)
    ggml_tensor * ggml_flash_attn_ext(ggml_context * ctx, ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * mask, float scale, float max_bias, float logit_softcap)
    ggml_tensor * ggml_im2col(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int s0, int s1, int p0, int p1, int d0, int d1, bint is_2D, ggml_type dst_type)
    ggml_tensor * ggml_conv_2d(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b, int s0, int s1, int p0, int p1, int d0, int d1)
    ggml_tensor * ggml_pool_2d(ggml_context * ctx, ggml_tensor * a, ggml_op_pool op, int k0, int k1, int s0, int s1, float p0, float p1)
    ggml_tensor * ggml_cross_entropy_loss(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
    ggml_tensor * ggml_opt_step_adamw(ggml_context * ctx, ggml_tensor * a, ggml_tensor * grad, ggml_tensor * m, ggml_tensor * v, ggml_tensor * adamw_params)
    ggml_tensor * ggml_opt_step_adamw_scaled(ggml_context * ctx, ggml_tensor * a, ggml_tensor * grad, ggml_tensor * m, ggml_tensor * v, ggml_tensor * adamw_params, ggml_tensor * scale)  # toy patch 0017

    # graphs
    ggml_cgraph * ggml_new_graph_custom(ggml_context * ctx, size_t size, bint grads)
    void ggml_build_forward_expand(ggml_cgraph * cgraph, ggml_tensor * tensor)
    void ggml_build_backward_expand(ggml_context * ctx, ggml_cgraph * cgraph, ggml_tensor ** grad_accs)
    void ggml_graph_reset(ggml_cgraph * cgraph)
    int ggml_graph_size(ggml_cgraph * cgraph)
    int ggml_graph_n_nodes(ggml_cgraph * cgraph)
    ggml_tensor * ggml_graph_node(ggml_cgraph * cgraph, int i)
    ggml_tensor * ggml_graph_get_grad(const ggml_cgraph * cgraph, const ggml_tensor * node)
    void ggml_graph_print(const ggml_cgraph * cgraph)

    # logging and quantization
    void ggml_log_set(ggml_log_callback log_callback, void * user_data)
    size_t ggml_quantize_chunk(ggml_type type, const float * src, void * dst, int64_t start, int64_t nrows, int64_t n_per_row, const float * imatrix)
    bint ggml_quantize_requires_imatrix(ggml_type type)


cdef extern from "ggml-toy.h" nogil:
    # toy patch 0025: the backward built in a context uses standard ops only (for a GPU)
    void ggml_toy_set_standard_backward(ggml_context * ctx, bint standard)
    bint ggml_toy_get_standard_backward(const ggml_context * ctx)
    # toy patch 0030: cross-entropy with I32 target ids as its labels
    ggml_tensor * ggml_toy_cross_entropy_loss_ids(ggml_context * ctx, ggml_tensor * a, ggml_tensor * b)
