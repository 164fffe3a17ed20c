// The vector kernels, written once over an instruction set's lanes (vec_avx2.h, vec_avx512.h:
// `LanesFor<T>::type`, the lanes a dtype runs in). No include guard: vector_kernels.cpp includes
// this file once per instruction set, inside that set's namespace, after its lanes, with
// OPTAMP_VEC_TARGET naming its target attribute.
//
// Per lane, each loop does what its scalar twin in cpu_kernels.h does per element (the same fp32
// operations in the same order, nothing fused: -ffp-contract=off), and it hands the elements
// after its last full vector to that twin. The non-finite test keeps, per lane, the largest
// exponent field (ExponentBits) of the values it looks at: it ends all ones exactly when one of
// them was inf or NaN (OR-ing would not do: finite exponents can OR to all ones). The values
// looked at are the ones unscale_math.h looks at: the value as stored, and axpby's x.

template <typename T, typename V = typename LanesFor<T>::type>
OPTAMP_VEC_TARGET bool unscale_vec(T* p, int64_t n, float inv_scale) {
  constexpr auto kExp = ExponentBits<T>::value;
  const auto s = V::set1(inv_scale);
  decltype(V::bits(p)) seen{};
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    seen = V::max_exponent(seen, V::store(p + i, V::mul(V::load(p + i), s)), kExp);
  }
  const bool bad = V::any_all_ones(seen, kExp);
  return unscale_scalar(p + i, n - i, inv_scale) || bad;
}

// Read-only: the raw bits are all the test needs, no conversion.
template <typename T, typename V = typename LanesFor<T>::type>
OPTAMP_VEC_TARGET bool check_vec(const T* p, int64_t n) {
  constexpr auto kExp = ExponentBits<T>::value;
  decltype(V::bits(p)) seen{};
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    seen = V::max_exponent(seen, V::bits(p + i), kExp);
  }
  const bool bad = V::any_all_ones(seen, kExp);
  return check_scalar(p + i, n - i) || bad;
}

// out may be x or y: both are loaded before out is stored.
template <typename T, typename V = typename LanesFor<T>::type>
OPTAMP_VEC_TARGET bool axpby_vec(T* out, const T* x, const T* y, int64_t n, float a, float b) {
  constexpr auto kExp = ExponentBits<T>::value;
  const auto va = V::set1(a), vb = V::set1(b);
  decltype(V::bits(x)) seen{};
  int64_t i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) {
    seen = V::max_exponent(seen, V::bits(x + i), kExp);
    const auto r = V::add(V::mul(va, V::load(x + i)), V::mul(vb, V::load(y + i)));
    seen = V::max_exponent(seen, V::store(out + i, r), kExp);
  }
  const bool bad = V::any_all_ones(seen, kExp);
  return axpby_scalar(out + i, x + i, y + i, n - i, a, b) || bad;
}
