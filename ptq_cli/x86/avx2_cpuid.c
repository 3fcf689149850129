/* ptq's AVX2 personality for a child process (x86/emulate.py): loaded before the process starts
   (LD_PRELOAD), it makes the CPUID instruction fault (Linux's ARCH_SET_CPUID, on CPUs with CPUID faulting) and answers
   it as the CPU does, less AVX-512, VNNI, AMX and AVX10. The libraries' CPU dispatch (onnxruntime's MLAS, fbgemm,
   oneDNN) then picks its AVX2 kernels, run natively: the saturating u8 x s8 products of a CPU without VNNI. */
#define _GNU_SOURCE
#include <cpuid.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <ucontext.h>
#include <unistd.h>

#define ARCH_SET_CPUID 0x1012
#define BIT(n) (1u << (n))

static volatile int status = -1; /* 0: CPUID answered here; 1, 2: the handler or the faulting could not be set */

static void mask(uint32_t leaf, uint32_t subleaf, uint32_t *a, uint32_t *b, uint32_t *c, uint32_t *d) {
    if (leaf == 7 && subleaf == 0) {
        /* AVX512 F, DQ, IFMA, PF, ER, CD, BW, VL */
        *b &= ~(BIT(16) | BIT(17) | BIT(21) | BIT(26) | BIT(27) | BIT(28) | BIT(30) | BIT(31));
        /* AVX512 VBMI, VBMI2, VNNI, BITALG, VPOPCNTDQ */
        *c &= ~(BIT(1) | BIT(6) | BIT(11) | BIT(12) | BIT(14));
        /* AVX512 4VNNIW, 4FMAPS, VP2INTERSECT; AMX-BF16, AVX512-FP16, AMX-TILE, AMX-INT8 */
        *d &= ~(BIT(2) | BIT(3) | BIT(8) | BIT(22) | BIT(23) | BIT(24) | BIT(25));
    } else if (leaf == 7 && subleaf == 1) {
        *a &= ~(BIT(4) | BIT(5) | BIT(21) | BIT(23));  /* AVX-VNNI, AVX512-BF16, AMX-FP16, AVX-IFMA */
        *d &= ~(BIT(4) | BIT(5) | BIT(10) | BIT(19));  /* AVX-VNNI-INT8, AVX-NE-CONVERT, AVX-VNNI-INT16, AVX10 */
    } else if (leaf == 0x1d || leaf == 0x1e || leaf == 0x24) {
        *a = *b = *c = *d = 0; /* AMX tiles, TMUL, AVX10 */
    }
}

static void on_fault(int signal_number, siginfo_t *info, void *context) {
    greg_t *regs = ((ucontext_t *)context)->uc_mcontext.gregs;
    const unsigned char *at = (const unsigned char *)regs[REG_RIP];
    /* A faulting CPUID is a general protection fault (SI_KERNEL) at its two bytes 0F A2; anything else is a real
       fault: the default action, on the instruction that made it. */
    if (info->si_code != SI_KERNEL || at[0] != 0x0f || at[1] != 0xa2) {
        signal(signal_number, SIG_DFL);
        return;
    }
    uint32_t a, b, c, d;
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 1);
    __cpuid_count((uint32_t)regs[REG_RAX], (uint32_t)regs[REG_RCX], a, b, c, d);
    syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0);
    mask((uint32_t)regs[REG_RAX], (uint32_t)regs[REG_RCX], &a, &b, &c, &d);
    regs[REG_RAX] = a;
    regs[REG_RBX] = b;
    regs[REG_RCX] = c;
    regs[REG_RDX] = d;
    regs[REG_RIP] += 2;
}

/* Before main: every thread the process makes after inherits the faulting CPUID. */
__attribute__((constructor)) static void start(void) {
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fault;
    action.sa_flags = SA_SIGINFO;
    sigemptyset(&action.sa_mask);
    if (sigaction(SIGSEGV, &action, NULL) != 0) {
        status = 1;
        return;
    }
    status = syscall(SYS_arch_prctl, ARCH_SET_CPUID, 0) == 0 ? 0 : 2;
}

int ptq_avx2_status(void) { return status; }
/* The features CPUID leaf 7 reports in this process: (ECX, EBX) as one 64-bit value. */
unsigned long long ptq_avx2_leaf7(void) {
    uint32_t a, b, c, d;
    __cpuid_count(7, 0, a, b, c, d);
    return ((unsigned long long)c << 32) | b;
}
