# Locate the CUTLASS/CuTe headers shipped by the pip package nvidia-cutlass (pinned in
# third_party/versions.txt). No third-party code is vendored into this repository.
# Override with -DPEAGLE_CUTLASS_INCLUDE=<dir> or the environment variable of the same name.
if(DEFINED ENV{PEAGLE_CUTLASS_INCLUDE} AND NOT "$ENV{PEAGLE_CUTLASS_INCLUDE}" STREQUAL "")
  set(PEAGLE_CUTLASS_INCLUDE "$ENV{PEAGLE_CUTLASS_INCLUDE}")
endif()
if(NOT PEAGLE_CUTLASS_INCLUDE)
  # find_spec does not import the package (its import pulls cuda-python and friends).
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c
            "import importlib.util, os; s = importlib.util.find_spec('cutlass_library'); print(os.path.join(os.path.dirname(s.origin), 'source', 'include') if s else '')"
    OUTPUT_VARIABLE _cutlass_inc OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
  if(_cutlass_inc AND EXISTS "${_cutlass_inc}/cute/tensor.hpp")
    set(PEAGLE_CUTLASS_INCLUDE "${_cutlass_inc}")
  endif()
endif()
if(PEAGLE_CUTLASS_INCLUDE)
  if(NOT EXISTS "${PEAGLE_CUTLASS_INCLUDE}/cute/tensor.hpp")
    message(FATAL_ERROR "PEAGLE_CUTLASS_INCLUDE=${PEAGLE_CUTLASS_INCLUDE} has no cute/tensor.hpp")
  endif()
  message(STATUS "peagle: CUTLASS/CuTe headers from ${PEAGLE_CUTLASS_INCLUDE}")
else()
  message(STATUS "peagle: CUTLASS/CuTe headers not found (pip install nvidia-cutlass==4.2.0.0); "
                 "kernels that need CuTe are not used")
endif()
