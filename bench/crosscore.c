// How fast the two CPUs of this machine pass data to each other, second by second, outside any
// library: two threads pinned to CPUs 0 and 1; each second (a) the round trip of one cache line
// bounced between them, (b) a producer/consumer copy of 64 KiB chunks through a 1 MiB ring of 16
// slots (what a shared-memory transport's ring or arena does).
//
//     gcc -O2 -pthread bench/crosscore.c -o /tmp/crosscore && /tmp/crosscore 30
//
// On the 2-core VM of 2026-12-06 evening most seconds gave 45-180 ns and 9-27 GB/s, and some
// windows of several seconds 465-590 ns and 2.2-4.4 GB/s: then shmdist's rings and arena slowed
// 4-10x with it, while copies made with process_vm_readv did not (README, Benchmarks, "When a
// single copy is slow").
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#define SLOT (64 << 10)
#define NSLOT 16
static _Alignas(64) atomic_long ping, pong;
static _Alignas(64) atomic_long head, tail;
static _Alignas(64) atomic_int phase;
static char *ring, *src, *dst;
static long rounds = 200000, chunks = 20000;
static double now(void){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
static void pin(int c){cpu_set_t s;CPU_ZERO(&s);CPU_SET(c,&s);pthread_setaffinity_np(pthread_self(),sizeof s,&s);}
static void *other(void *a){
  pin(1);
  for(;;){
    int ph; while((ph=atomic_load(&phase))==0);
    if(ph<0) return 0;
    // ping-pong
    for(long i=1;i<=rounds;i++){ while(atomic_load_explicit(&ping,memory_order_acquire)!=i); atomic_store_explicit(&pong,i,memory_order_release);}
    // consumer
    for(long i=0;i<chunks;i++){ while(atomic_load_explicit(&head,memory_order_acquire)<=i); memcpy(dst,ring+(i%NSLOT)*SLOT,SLOT); atomic_store_explicit(&tail,i+1,memory_order_release);}
    atomic_store(&phase,0);
  }
}
int main(int argc,char**argv){
  int secs=argc>1?atoi(argv[1]):10;
  ring=aligned_alloc(4096,NSLOT*SLOT); src=aligned_alloc(4096,SLOT); dst=aligned_alloc(4096,SLOT);
  memset(ring,1,NSLOT*SLOT); memset(src,2,SLOT); memset(dst,3,SLOT);
  pthread_t t; pthread_create(&t,0,other,0); pin(0);
  for(int s=0;s<secs;s++){
    atomic_store(&ping,0);atomic_store(&pong,0);atomic_store(&head,0);atomic_store(&tail,0);
    atomic_store(&phase,1);
    double t0=now();
    for(long i=1;i<=rounds;i++){ atomic_store_explicit(&ping,i,memory_order_release); while(atomic_load_explicit(&pong,memory_order_acquire)!=i);}
    double t1=now();
    for(long i=0;i<chunks;i++){ while(i-atomic_load_explicit(&tail,memory_order_acquire)>=NSLOT); memcpy(ring+(i%NSLOT)*SLOT,src,SLOT); atomic_store_explicit(&head,i+1,memory_order_release);}
    while(atomic_load(&phase)!=0);
    double t2=now();
    printf("%.1f s: line round trip %.0f ns, 64 KiB ring copy %.1f GB/s\n", t2, (t1-t0)/rounds*1e9, (double)chunks*SLOT/(t2-t1)/1e9);
    fflush(stdout);
    double left=1.0-(now()-t0); if(left>0) usleep((useconds_t)(left*1e6));
  }
  atomic_store(&phase,-1); pthread_join(t,0); return 0;
}
