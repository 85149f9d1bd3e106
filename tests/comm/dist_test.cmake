# fsdp_dist_test(<name> SOURCES ... NPROC <n...> [TIMEOUT s] [LABELS ...])
# Multi-process test through fsdprun (fsdp_add_test ... NPROC). While apps/fsdprun is not part of the build
# (e.g. configured with FSDP_BUILD_APPS=OFF), the ranks are started by tests/comm/run_local.sh instead, so the
# tests stay runnable.
function(fsdp_dist_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;NPROC;LABELS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 120)
  endif()
  if(TARGET fsdprun)
    fsdp_add_test(${name} SOURCES ${T_SOURCES} NPROC ${T_NPROC} TIMEOUT ${T_TIMEOUT} LABELS ${T_LABELS})
  else()
    add_executable(${name} ${T_SOURCES})
    target_link_libraries(${name} PRIVATE fsdp GTest::gtest GTest::gtest_main)
    target_include_directories(${name} PRIVATE ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/src)
    math(EXPR _ctest_timeout "${T_TIMEOUT} + 30")
    foreach(n ${T_NPROC})
      add_test(NAME ${name}.np${n}
               COMMAND ${PROJECT_SOURCE_DIR}/tests/comm/run_local.sh ${n} ${T_TIMEOUT} $<TARGET_FILE:${name}>)
      set_tests_properties(${name}.np${n} PROPERTIES TIMEOUT ${_ctest_timeout}
                           LABELS "multiprocess;${T_LABELS}" PROCESSORS ${n})
    endforeach()
  endif()
endfunction()
